"""Account > API keys: "Revoke" asks first, naming the key (hx-confirm, as the other
destructive buttons); the confirmed request revokes it and reloads the account page with a
notice; dismissing the question revokes nothing (trial finding; a real headless Chromium)."""
from __future__ import annotations

import pytest

from tests.web.test_web_browser import CHROMIUM, page  # noqa: F401 - the signed-in page fixture


def _key(client, name: str = "laptop") -> dict:
    r = client.post("/api/keys", json={"name": name})
    assert r.status_code in (200, 201), r.text
    return next(k for k in client.get("/api/keys").json() if k["name"] == name)


def _question(key: dict) -> str:
    return (f"Revoke the API key {key['name']} ({key['prefix']}…)? Programs using it are "
            "refused at once; this cannot be undone.")


def test_revoke_asks_first_naming_the_key(client):
    key = _key(client)
    html = client.get("/account").text
    form = html[html.index(f'hx-post="/account/keys/{key["id"]}/revoke"'):]
    assert form.index(f'hx-confirm="{_question(key)}"') < form.index("Revoke</button>")
    r = client.post(f"/account/keys/{key['id']}/revoke", headers={"HX-Request": "true"},
                    follow_redirects=False)
    assert r.status_code == 200 and r.headers["HX-Redirect"] == "/account"
    assert all(k["id"] != key["id"] for k in client.get("/api/keys").json())
    assert "Revoked the key laptop." in client.get("/account").text


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")
def test_revoke_in_the_browser_waits_for_the_answer(page, client):  # noqa: F811
    from playwright.sync_api import expect

    key = _key(client, "ci-runner")
    page.goto(f"{page.base}/account")
    asked: list[str] = []
    page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
    row = page.locator("tr", has=page.get_by_text("ci-runner"))
    row.get_by_role("button", name="Revoke").click()
    page.wait_for_timeout(300)  # a request sent anyway would have landed by now
    assert asked == [_question(key)]
    assert any(k["id"] == key["id"] for k in client.get("/api/keys").json())
    page.once("dialog", lambda d: d.accept())
    row.get_by_role("button", name="Revoke").click()
    expect(page.get_by_text("Revoked the key ci-runner.")).to_be_visible()
    assert all(k["id"] != key["id"] for k in client.get("/api/keys").json())
