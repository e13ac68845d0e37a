"""Admin > Users: "Disable" asks first, naming the user (hx-confirm, as run delete does); the
confirmed request disables them and reloads the admin page; dismissing the question changes
nothing (a real headless Chromium)."""
from __future__ import annotations

import pytest

from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture

QUESTION = ("Disable user bea? They are signed out everywhere and cannot sign in or use their "
            "API keys until an admin enables them again. Their waiting jobs are held (not "
            "started) until then; their running jobs continue to the end.")


def _bea(client) -> str:
    r = client.post("/api/users", json={"name": "bea", "password": "member-password-1"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _disabled(client, uid: str) -> bool:
    return next(u for u in client.get("/api/users").json() if u["id"] == uid)["disabled"]


def test_disable_asks_first_naming_the_user(client):
    uid = _bea(client)
    html = client.get("/admin").text
    form = html[html.index(f'hx-post="/admin/users/{uid}"'):]
    assert form.index('hx-confirm="' + QUESTION) < form.index("Disable</button>")
    r = client.post(f"/admin/users/{uid}", data={"action": "disabled", "value": "true"},
                    headers={"HX-Request": "true"}, follow_redirects=False)
    assert r.status_code == 200 and r.headers["HX-Redirect"] == "/admin"
    assert _disabled(client, uid)
    html = client.get("/admin").text
    assert "Updated bea." in html and "Enable</button>" in html
    assert "Disable user bea?" not in html  # enabling again needs no question


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_disable_in_the_browser_waits_for_the_answer(page, client):  # noqa: F811
    from playwright.sync_api import expect

    uid = _bea(client)
    page.goto(f"{page.base}/admin")
    asked: list[str] = []
    page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
    row = page.locator("tr", has=page.locator("strong", has_text="bea"))
    row.get_by_role("button", name="Disable").click()
    expect(row.get_by_role("button", name="Disable")).to_be_enabled()
    page.wait_for_timeout(300)  # a request sent anyway would have landed by now
    assert asked == [QUESTION] and not _disabled(client, uid)
    page.once("dialog", lambda d: d.accept())
    row.get_by_role("button", name="Disable").click()
    expect(page.get_by_text("Updated bea.")).to_be_visible()
    expect(row.get_by_role("button", name="Enable")).to_be_visible()
    assert _disabled(client, uid)
