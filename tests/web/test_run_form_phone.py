"""The new-run form at a phone's width (390 px) scrolls only vertically (trial finding: 15 px
too wide); a real headless Chromium."""
from __future__ import annotations

import pytest

from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")]


def test_new_run_form_fits_a_390_px_phone(page):  # noqa: F811
    page.set_viewport_size({"width": 390, "height": 844})
    for url in ("/runs/new", "/runs/new/grpo"):
        page.goto(f"{page.base}{url}")
        page.wait_for_load_state("networkidle")
        wide = page.evaluate("""() => [...document.querySelectorAll('body *')]
            .filter((e) => e.getBoundingClientRect().right > 390.5)
            .map((e) => `${e.tagName}#${e.id}.${e.className} ${e.getBoundingClientRect().right}`)
            .slice(0, 12)""")
        widths = page.evaluate("() => [document.documentElement.scrollWidth,"
                               " document.body.scrollWidth, window.innerWidth]")
        assert widths[0] <= 390 and widths[1] <= 390 and widths[2] == 390, (url, widths, wide)
