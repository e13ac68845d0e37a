"""The browser shows what the server renders for 4xx answers (htmx 2 swaps none by default).

A real headless Chromium (Debian's package) against the app served by uvicorn on a loopback
port and a temporary data dir; skipped when chromium or Playwright is missing.
"""
from __future__ import annotations

import re
import shutil

import pytest

from tests.conftest import SHARED_DATA as SHARED
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")]


@pytest.fixture
def page(server):
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = browser.new_page()
        pg.set_default_timeout(20_000)
        pg.base = server
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(f"{server}/datasets")  # signed out: the sign-in page, then back here
        pg.fill("input[name=username]", ADMIN_USER)
        pg.fill("input[name=password]", ADMIN_PASSWORD)
        pg.click("form[action='/login'] button[type=submit]")
        pg.wait_for_url(f"{server}/datasets")
        yield pg
        browser.close()
        assert not errors, errors


def test_validation_errors_are_visible_in_the_browser(page, client):
    from playwright.sync_api import expect

    # an upload the dataset layer rejects (400): the reason appears under the form
    page.goto(f"{page.base}/datasets")
    page.set_input_files("#upload_form input[type=file]",
                         str(SHARED / "messy" / "sharegpt_empty_assistant_turn.json"))
    page.click("#upload_form button[type=submit]")
    expect(page.locator("#upload_form .alert.error")).to_contain_text(
        "row 1, field 'conversations[1].value': empty assistant turn")
    assert page.url.endswith("/datasets")

    # a good upload, then a run form without target modules (422): the field says why
    page.set_input_files("#upload_form input[type=file]", str(SHARED / "sft" / "alpaca_en_demo.json"))
    page.click("#upload_form button[type=submit]")
    page.wait_for_url("**/datasets/file-*")
    dataset_url = page.url
    # the report selector: Enter in max_seq_length recomputes the report through htmx (the
    # browser's own min=8 check stops smaller values before any request)
    page.fill("#report_form input[name=max_seq_length]", "64")
    page.press("#report_form input[name=max_seq_length]", "Enter")
    expect(page.locator("#train-link")).to_have_attribute("href", re.compile("max_seq_length=64"))
    expect(page.locator("#report")).to_contain_text("Over max_seq_length (64)")
    assert page.url == dataset_url
    page.goto(f"{page.base}/runs/new")
    for box in page.locator("input[name=target_modules]").all():
        box.uncheck()
    page.click("#run_form button[type=submit]")
    expect(page.locator("#run_form fieldset.invalid .field-error")).to_contain_text("at least 1 item")
    expect(page.locator("#run_form button[type=submit]")).to_be_enabled()
    assert page.url.endswith("/runs/new")

    # an error that is not a form's (404 here) shows the friendly error card in the page
    page.evaluate("() => htmx.ajax('GET', '/datasets/file-nope', {target: '#run_form'})")
    expect(page.locator("main .error-page")).to_contain_text("no dataset with id")
