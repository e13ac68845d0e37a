"""Sign-in, sessions, API keys, access tokens, CSRF, the Host allow-list and first-start setup,
driven over HTTP against the real app on a real SQLite file."""
from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from app.settings import Settings
from app.store.db import reset_engines
from app.studio import accounts
from tests.web.conftest import login_form_token

ADMIN_PW = "admin-password-1"
INVALID = "invalid or revoked API key or access token"
BASE = "http://localhost"
LOGIN = "/api/login/access-token"


def _build(settings: Settings):
    from app.web.main import create_app

    return create_app(settings)


@pytest.fixture
def client(make_client) -> TestClient:
    """The studio with admin ``admin`` (WHETSTONE_ADMIN_PASSWORD) and member ``alice``."""
    c = make_client(admin_password=ADMIN_PW, login_attempts_per_minute=3)
    engine = c.app.state.engine
    admin = accounts.authenticate(engine, "admin", ADMIN_PW)
    accounts.create_user(engine, "alice", "alice-password", actor=admin)
    accounts.create_user(engine, "bob", "bob-password-1", actor=admin)
    return c


def sign_in(c: TestClient, name: str, password: str) -> str:
    """Sign ``c`` in through the form; returns the session's CSRF token from /account."""
    r = c.post("/login", data={"username": name, "password": password, "next": "/account",
                               "csrf_token": login_form_token(c)},
               follow_redirects=False)
    assert r.status_code == 303, r.text
    assert r.headers["location"] == "/account"
    page = c.get("/account")
    assert page.status_code == 200
    return re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)


def bearer(c: TestClient, name: str, password: str) -> dict[str, str]:
    r = c.post(LOGIN, data={"username": name, "password": password})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["token_type"] == "bearer"
    return {"Authorization": f"Bearer {body['access_token']}"}


def test_sign_in_form_refuses_posts_without_its_pre_session_token(client):
    """Login CSRF: a third-party page (no token, the attacker's own token, another origin)
    cannot sign a visitor in; the OAuth2 endpoint for scripts needs no cookie."""
    form = {"username": "alice", "password": "alice-password"}
    r = client.post("/login", data=form, follow_redirects=False)  # curl: no cookie, no token
    assert r.status_code == 403 and "token cookie is missing" in r.text
    assert "whetstone_session" not in r.headers.get("set-cookie", "")
    attacker = TestClient(client.app, base_url=BASE)
    stolen = login_form_token(attacker)  # a valid token, but bound to the attacker's cookie
    token = login_form_token(client)
    assert client.cookies.get("whetstone_signin_csrf") == token != stolen
    r = client.post("/login", data={**form, "csrf_token": stolen}, follow_redirects=False)
    assert r.status_code == 403 and "does not match" in r.text
    r = client.post("/login", data=form, follow_redirects=False)  # cookie sent, field missing
    assert r.status_code == 403 and "missing token" in r.text
    r = client.post("/login", data={**form, "csrf_token": token}, follow_redirects=False,
                    headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "another origin" in r.text
    assert client.get("/api/me").status_code == 401  # none of them signed in
    r = client.post("/login", data={**form, "csrf_token": token}, follow_redirects=False,
                    headers={"Origin": BASE})
    assert r.status_code == 303 and client.get("/api/me").json()["name"] == "alice"
    cookieless = TestClient(client.app, base_url=BASE).post(LOGIN, data=form)
    assert cookieless.status_code == 200 and cookieless.json()["token_type"] == "bearer"


def test_sign_in_and_out_with_a_session_cookie(client):
    r = client.get("/account", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login?next=%2Faccount"
    r = client.post("/login", data={"username": "alice", "password": "alice-password",
                                    "next": "/account", "csrf_token": login_form_token(client)},
                    follow_redirects=False)
    cookie = r.headers["set-cookie"]
    assert "whetstone_session=" in cookie and "HttpOnly" in cookie
    assert "SameSite=lax" in cookie and "Max-Age=604800" in cookie and "Secure" not in cookie
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/account").text).group(1)
    me = client.get("/api/me").json()
    assert me["name"] == "alice" and me["role"] == "member" and "password_hash" not in me
    stolen = client.cookies.get("whetstone_session")

    r = client.post("/logout", data={"csrf_token": csrf}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login"
    assert client.get("/api/me").status_code == 401
    client.cookies.set("whetstone_session", stolen)  # a copied cookie dies with the session
    assert client.get("/api/me").status_code == 401
    client.cookies.set("whetstone_session", stolen[:-2] + "xx")  # a forged signature
    assert client.get("/api/me").status_code == 401


def test_wrong_password_and_unknown_user_get_the_same_401(client):
    wrong = client.post(LOGIN, data={"username": "alice", "password": "nope-nope"})
    unknown = client.post(LOGIN, data={"username": "zed", "password": "nope-nope"})
    assert wrong.status_code == unknown.status_code == 401
    assert wrong.json()["error"]["message"] == unknown.json()["error"]["message"] \
        == "wrong user name or password"
    page = client.post("/login", data={"username": "alice", "password": "bad-password",
                                       "csrf_token": login_form_token(client)})
    assert page.status_code == 401 and "wrong user name or password" in page.text


def test_sign_in_attempts_are_rate_limited(client):
    for _ in range(3):
        r = client.post(LOGIN, data={"username": "bob", "password": "x" * 9})
        assert r.status_code == 401
    r = client.post(LOGIN, data={"username": "bob", "password": "bob-password-1"})
    assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60
    page = client.post("/login", data={"username": "bob", "password": "bob-password-1",
                                       "csrf_token": login_form_token(client)})
    assert page.status_code == 429 and "Too many sign-in attempts" in page.text
    assert client.post(LOGIN,  # another name is counted apart
                       data={"username": "alice", "password": "alice-password"}).status_code == 200


def test_access_token_and_api_key_as_bearer(client):
    auth = bearer(client, "alice", "alice-password")
    assert client.get("/api/me", headers=auth).json()["name"] == "alice"
    r = client.post("/api/keys", json={"name": "laptop"}, headers=auth)
    assert r.status_code == 201
    made = r.json()
    assert made["key"].startswith("wk-") and len(made["key"]) > 40
    assert made["prefix"] == made["key"][:8] and made["name"] == "laptop"
    key = {"Authorization": f"Bearer {made['key']}"}
    assert client.get("/api/me", headers=key).json()["name"] == "alice"
    listed = client.get("/api/keys", headers=key).json()
    assert [k["id"] for k in listed] == [made["id"]] and "key" not in listed[0]
    assert listed[0]["last_used_at"] is not None

    bob = bearer(client, "bob", "bob-password-1")
    assert client.delete(f"/api/keys/{made['id']}", headers=bob).status_code == 404
    assert client.get("/api/me", headers=key).status_code == 200
    assert client.delete(f"/api/keys/{made['id']}", headers=auth).status_code == 204
    r = client.get("/api/me", headers=key)
    assert r.status_code == 401
    assert r.json()["error"]["message"] == "invalid or revoked API key or access token"
    assert client.get("/api/keys", headers=auth).json() == []
    r = client.get("/v1/models", headers={"Authorization": "Bearer wk-not-a-key"})
    assert r.status_code == 401 and r.json()["error"] == {
        "message": "invalid or revoked API key or access token", "type": "authentication_error",
        "param": None, "code": "invalid_api_key"}


def test_admin_may_revoke_any_key_and_a_disabled_user_is_out_at_once(client):
    alice = bearer(client, "alice", "alice-password")
    kid = client.post("/api/keys", json={"name": "k"}, headers=alice).json()["id"]
    admin = bearer(client, "admin", ADMIN_PW)
    assert client.delete(f"/api/keys/{kid}", headers=admin).status_code == 204
    engine = client.app.state.engine
    actor = accounts.authenticate(engine, "admin", ADMIN_PW)
    alice_id = client.get("/api/me", headers=alice).json()["id"]
    live = client.post("/api/keys", json={"name": "k2"}, headers=alice).json()["key"]
    accounts.set_disabled(engine, actor, alice_id, True)
    # her unrevoked key and her access token say why they stop working (trials s24, s25:
    # "invalid or revoked")
    for path, auth in [(p, a) for p in ("/api/me", "/v1/models")
                       for a in (alice, {"Authorization": f"Bearer {live}"})]:
        r = client.get(path, headers=auth)
        assert r.status_code == 401, r.text
        assert (r.json()["error"]["message"], r.json()["error"]["code"]) == (
            "this account is disabled; ask an admin", "account_disabled")
    r = client.post(LOGIN, data={"username": "alice", "password": "alice-password"})
    assert r.status_code == 401 and (r.json()["error"]["message"], r.json()["error"]["code"]) \
        == ("this account is disabled; ask an admin", "account_disabled")
    accounts.set_disabled(engine, actor, alice_id, False)
    assert client.get("/api/me", headers={"Authorization": f"Bearer {live}"}).status_code == 200
    # re-enabled, her key works again; the sign-in made before she was disabled stays ended
    r = client.get("/api/me", headers=alice)
    assert r.status_code == 401 and r.json()["error"]["message"] == INVALID, r.text


def test_users_api_is_for_admins(client):
    member = bearer(client, "alice", "alice-password")
    assert client.get("/api/users", headers=member).status_code == 403
    r = client.post("/api/users", json={"name": "carol", "password": "carol-pass"}, headers=member)
    assert r.status_code == 403
    admin = bearer(client, "admin", ADMIN_PW)
    carol = {"name": "carol", "password": "carol-pass", "role": "member"}
    r = client.post("/api/users", json=carol, headers=admin)
    assert r.status_code == 201 and r.json()["name"] == "carol" and r.json()["role"] == "member"
    assert client.post("/api/users", json={"name": "Carol", "password": "carol-pass"},
                       headers=admin).status_code == 409
    r = client.post("/api/users", json={"name": "dave", "password": "short"}, headers=admin)
    assert r.status_code == 422 and r.json()["error"]["param"] == "password"
    names = [u["name"] for u in client.get("/api/users", headers=admin).json()]
    assert names == ["admin", "alice", "bob", "carol"]
    assert client.get("/api/users").status_code == 401


def test_csrf_on_cookie_requests(client):
    csrf = sign_in(client, "alice", "alice-password")
    r = client.post("/account/keys", data={"name": "no-token"})
    assert r.status_code == 403 and "CSRF check failed" in r.text
    r = client.post("/api/keys", json={"name": "no-token"})
    assert r.status_code == 403 and r.json()["error"]["message"].startswith("CSRF check failed")
    r = client.post("/account/keys", data={"name": "wrong"}, headers={"X-CSRF-Token": "x" * 20})
    assert r.status_code == 403 and "does not match" in r.text
    r = client.post("/api/keys", json={"name": "by-header"}, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 201
    r = client.post("/account/keys", data={"name": "by-field", "csrf_token": csrf})
    assert r.status_code == 200 and "by-field" in r.text and "wk-" in r.text  # after the 303
    r = client.post("/account/keys", data={"name": "evil", "csrf_token": csrf},
                    headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "another origin" in r.text
    r = client.post("/account/keys", data={"name": "evil2", "csrf_token": csrf},
                    headers={"Referer": "http://127.0.0.1:9/page"})
    assert r.status_code == 403
    r = client.post("/account/keys", data={"name": "same-origin", "csrf_token": csrf},
                    headers={"Origin": BASE})
    assert r.status_code == 200 and str(r.url) == f"{BASE}/account"
    r = client.post("/account/keys", files={"csrf_token": (None, csrf),  # the first field
                                            "name": (None, "multipart")})
    assert r.status_code == 200 and "multipart" in r.text
    r = client.post(f"/account/keys?csrf_token={csrf}", files={"name": (None, "in-url")})
    assert r.status_code == 403  # a token in the URL (access logs) is not read
    names = sorted(k["name"] for k in client.get("/api/keys").json())
    assert names == ["by-field", "by-header", "multipart", "same-origin"]


def test_bearer_requests_need_no_csrf_token(client):
    auth = bearer(client, "alice", "alice-password")
    r = client.post("/api/keys", json={"name": "k"}, headers={**auth, "Origin": "http://other"})
    assert r.status_code == 201


def test_foreign_host_is_refused(client):
    r = client.get("/login", headers={"Host": "evil.example"})
    assert r.status_code == 400 and "not served" in r.text
    assert client.get("/healthz", headers={"Host": "attacker.test:8000"}).status_code == 400
    assert client.get("/login", headers={"Host": "127.0.0.1:8000"}).status_code == 200


def test_allowed_hosts_setting(make_client):
    c = make_client(admin_password=ADMIN_PW, allowed_hosts="studio.lan")
    assert c.get("/login", headers={"Host": "studio.lan:8000"}).status_code == 200
    assert c.get("/login", headers={"Host": "localhost"}).status_code == 400


def test_anonymous_callers_per_surface(client):
    r = client.get("/", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login?next=%2F"
    r = client.get("/datasets", headers={"HX-Request": "true"}, follow_redirects=False)
    assert r.status_code == 401 and r.headers["hx-retarget"] == "#session-alert"  # no redirect
    r = client.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = client.get("/api/exports/1/events")
    assert r.status_code == 401 and "error" in r.json()
    assert client.get("/healthz").status_code == 200
    assert client.get("/api/openapi.json").status_code == 200


def test_signed_in_pages_and_admin_page(client):
    sign_in(client, "alice", "alice-password")
    assert client.get("/").status_code == 200
    assert client.get("/admin").status_code == 403
    client.cookies.clear()
    csrf = sign_in(client, "admin", ADMIN_PW)
    page = client.get("/admin")
    assert page.status_code == 200 and "alice" in page.text and "login.succeeded" in page.text
    r = client.post("/admin/users", data={"name": "erin", "password": "erin-pass-1",
                                          "role": "member", "csrf_token": csrf})
    assert r.status_code == 200 and "Created erin" in r.text and str(r.url) == f"{BASE}/admin"
    erin = next(u for u in accounts.list_users(client.app.state.engine,
                                               accounts.authenticate(client.app.state.engine,
                                                                     "admin", ADMIN_PW))
                if u.name == "erin")
    r = client.post(f"/admin/users/{erin.id}", data={"action": "custom_rewards", "value": "true",
                                                     "csrf_token": csrf})
    assert r.status_code == 200
    assert accounts.get_user(client.app.state.engine, erin.id).can_run_custom_rewards is True


def test_first_start_setup_link_works_once(make_client, capsys):
    c = make_client()
    out = capsys.readouterr().out
    link = re.search(r"http://127\.0\.0\.1:8000(/setup\?token=\S+)", out).group(1)
    assert c.get("/api/me").status_code == 401
    assert c.get("/setup?token=wrong").status_code == 404
    assert "Create the admin account" in c.get(link).text
    token = link.split("token=")[1]
    form = login_form_token(c, link)
    r = c.post("/setup", data={"token": token, "name": "root", "password": "short",
                               "password2": "short", "csrf_token": form})
    assert r.status_code == 422 and "at least 8 characters" in r.text
    r = c.post("/setup", data={"token": token, "name": "root", "password": "root-password",
                               "password2": "root-password", "csrf_token": form},
               follow_redirects=False)
    assert r.status_code == 303
    me = c.get("/api/me").json()
    assert me["name"] == "root" and me["role"] == "admin"
    assert c.get(link).status_code == 404
    c.cookies.clear()
    c.cookies.set("whetstone_signin_csrf", form)  # signed out, the setup form's token kept
    r = c.post("/setup", data={"token": token, "name": "other", "password": "other-password",
                               "password2": "other-password", "csrf_token": form})
    assert r.status_code == 404
    assert [u.name for u in accounts.list_users(c.app.state.engine, accounts.get_user(
        c.app.state.engine, me["id"]))] == ["root"]


def test_refuses_to_start_on_a_public_address_without_users(tmp_path):
    app = _build(Settings(data_dir=tmp_path / "data", host="0.0.0.0"))
    with pytest.raises(RuntimeError, match="WHETSTONE_ADMIN_PASSWORD"):
        with TestClient(app, base_url=BASE):
            pass
    reset_engines()


def test_expired_token_secure_cookie_and_no_open_redirect(client, make_client):
    engine = client.app.state.engine
    alice = accounts.authenticate(engine, "alice", "alice-password")
    token, row = accounts.new_token(engine, alice, "access", hours=-0.01)
    assert row.expires_at < row.created_at
    assert client.get("/api/me", headers={"Authorization": f"Bearer {token}"}).status_code == 401
    r = client.post("/login", data={"username": "alice", "password": "alice-password",
                                    "next": "//evil.example/x",
                                    "csrf_token": login_form_token(client)},
                    follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/"
    secure = TestClient(client.app, base_url="https://localhost")
    r = secure.post("/login", data={"username": "bob", "password": "bob-password-1",
                                    "csrf_token": login_form_token(secure)},
                    follow_redirects=False)
    assert r.status_code == 303 and "Secure" in r.headers["set-cookie"]


def test_sign_in_takes_the_name_in_any_case(client):
    """Names are unique ignoring case ('ALICE' is refused as taken by 'alice'), so sign-in takes
    any case too (trial s24 M-8: 'Alice' got 'wrong user name or password')."""
    for name in ("ALICE", "Alice", " alice "):
        r = client.post(LOGIN, data={"username": name, "password": "alice-password"})
        assert r.status_code == 200, (name, r.text)
        me = client.get("/api/me", headers={"Authorization": f"Bearer {r.json()['access_token']}"})
        assert me.status_code == 200 and me.json()["name"] == "alice", me.text
    assert client.post(LOGIN, data={"username": "ALICE", "password": "wrong-one-1"}).status_code == 401
    page = client.post("/login", data={"username": "Alice", "password": "alice-password",
                                       "csrf_token": login_form_token(client)},
                       follow_redirects=False)
    assert page.status_code == 303, page.text
