"""Sign out everywhere else (trial s22 F11): the account page lists the user's sessions and its
"Sign out all other sessions" ends every other session and access token; this one and the API
keys stay."""
from __future__ import annotations

import re

from fastapi.testclient import TestClient

from app.studio import accounts
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, BASE_URL, login_form_token

URL = "/account/sessions/sign-out-others"


def _browser(app, name: str, password: str) -> tuple[TestClient, str]:
    """A started cookie client signed in through the form; with its session's CSRF token."""
    c = TestClient(app, base_url=BASE_URL)
    c.__enter__()
    r = c.post("/login", data={"username": name, "password": password, "next": "/account",
                               "csrf_token": login_form_token(c)}, follow_redirects=False)
    assert r.status_code == 303, r.text
    page = c.get("/account").text
    return c, re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)


def test_sign_out_all_other_sessions(app, engine):
    admin = accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD)
    bob = accounts.create_user(engine, "bob", "bob-password-1", actor=admin)
    here, csrf = _browser(app, "bob", "bob-password-1")
    there, _ = _browser(app, "bob", "bob-password-1")
    admin_browser, _ = _browser(app, ADMIN_USER, ADMIN_PASSWORD)
    bare = TestClient(app, base_url=BASE_URL)  # no cookie: Bearer credentials only
    token = bare.post("/api/login/access-token",
                      data={"username": "bob", "password": "bob-password-1"}).json()["access_token"]
    _, key = accounts.create_api_key(engine, bob, "laptop")
    try:
        page = here.get("/account").text
        listed = page.split('id="session-list"', 1)[1].split("</table>", 1)[0]
        assert listed.count("<tr><td>") == 3 and listed.count("this session") == 1
        assert listed.count("browser session") == 2 and listed.count("access token") == 1
        assert "API keys are not sessions" in page

        # the form is CSRF-protected like the page's others: without the token nothing ends
        assert here.post(URL, follow_redirects=False).status_code == 403
        assert there.get("/account", follow_redirects=False).status_code == 200

        r = here.post(URL, data={"csrf_token": csrf}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/account#sessions"
        page = here.get("/account").text
        assert "Signed out 2 other sessions." in page
        listed = page.split('id="session-list"', 1)[1].split("</table>", 1)[0]
        assert listed.count("<tr><td>") == 1 and "this session" in listed

        r = there.get("/account", follow_redirects=False)
        assert r.status_code in (302, 303, 307) and r.headers["location"].startswith("/login")
        assert there.get("/api/me").status_code == 401
        assert bare.get("/api/me", headers={"Authorization": f"Bearer {token}"}).status_code == 401
        assert bare.get("/api/me", headers={"Authorization": f"Bearer {key}"}).json()["name"] \
            == "bob"  # API keys stay
        assert here.get("/api/me").json()["name"] == "bob"
        assert admin_browser.get("/api/me").json()["name"] == ADMIN_USER  # another user's stays

        assert here.post(URL, data={"csrf_token": csrf}, follow_redirects=False).status_code == 303
        assert "There were no other sessions to sign out." in here.get("/account").text
    finally:
        for c in (here, there, admin_browser):
            c.__exit__(None, None, None)
