"""Account hardening, over HTTP against the real app on a real SQLite file: forwarded headers
trusted only from named proxies, the per-address sign-in limit, no-store / Vary / anti-framing
headers, a password change ending the other sign-ins, POST-redirect-GET with one-time messages,
the invalid-Bearer answer, and the admin's audit log filters and paging."""
from __future__ import annotations

import re
import socket
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from app.settings import Settings
from app.store.db import reset_engines
from app.studio import accounts, audit
from tests.web.conftest import login_form_token

ADMIN_PW = "admin-password-1"
BASE = "http://localhost"
LOGIN = "/api/login/access-token"
INVALID = "invalid or revoked API key or access token"


@pytest.fixture
def studio(make_client):
    """``studio(**settings)`` -> a started TestClient (``make_client``) with admin ``admin``
    (WHETSTONE_ADMIN_PASSWORD) and members ``alice`` and ``bob``."""

    def make(**kw) -> TestClient:
        c = make_client(admin_password=ADMIN_PW, **kw)
        engine = c.app.state.engine
        admin = accounts.authenticate(engine, "admin", ADMIN_PW)
        accounts.create_user(engine, "alice", "alice-password", actor=admin)
        accounts.create_user(engine, "bob", "bob-password-1", actor=admin)
        return c

    return make


@pytest.fixture
def client(studio) -> TestClient:
    return studio(login_attempts_per_minute=3, login_attempts_per_address_per_minute=5)


def sign_in(c: TestClient, name: str, password: str) -> str:
    """Sign ``c`` in through the form; returns the session's CSRF token."""
    r = c.post("/login", data={"username": name, "password": password, "next": "/account",
                               "csrf_token": login_form_token(c)},
               follow_redirects=False)
    assert r.status_code == 303, r.text
    return re.search(r'name="csrf_token" value="([^"]+)"', c.get("/account").text).group(1)


def bearer(c: TestClient, name: str, password: str) -> dict[str, str]:
    """An access token's header, from a cookie-less client of ``c``'s app."""
    r = TestClient(c.app, base_url=BASE).post(LOGIN, data={"username": name, "password": password})
    assert r.status_code == 200, r.text
    return {"Authorization": f"Bearer {r.json()['access_token']}"}


# ---- 1: forwarded headers, per-address limit ----------------------------------------------------
def _serve(settings: Settings, log_level: str = "warning"):
    """The app served by uvicorn with the config ``whetstone-web`` uses; returns the server, its
    thread and the base URL."""
    import uvicorn

    from app.web.main import create_app, server_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(server_config(create_app(settings), settings, host="127.0.0.1",
                                       port=port, log_level=log_level))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started
    return srv, th, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("proxies", ["", "127.0.0.1"])
def test_forwarded_for_is_trusted_only_from_named_proxies(tmp_path, proxies):
    settings = Settings(data_dir=tmp_path / "data", admin_password=ADMIN_PW,
                        login_attempts_per_minute=3, forwarded_allow_ips=proxies)
    srv, th, base = _serve(settings)
    try:
        codes = [httpx.post(f"{base}{LOGIN}", data={"username": "admin", "password": "wrong-pw-1"},
                            headers={"X-Forwarded-For": f"10.0.0.{i}"}).status_code
                 for i in range(5)]
        if not proxies:  # a spoofed header changes nothing: one client, limited after 3
            assert codes == [401, 401, 401, 429, 429]
        else:  # a trusted proxy names each client: five clients, one attempt each
            assert codes == [401] * 5
            again = [httpx.post(f"{base}{LOGIN}", data={"username": "admin", "password": "x" * 9},
                                headers={"X-Forwarded-For": "10.0.0.1"}).status_code
                     for _ in range(3)]
            assert again == [401, 401, 429]
    finally:
        srv.should_exit = True
        th.join(timeout=10)
        reset_engines()


def test_failed_sign_ins_are_limited_per_address_across_names(client):
    engine = client.app.state.engine
    for _ in range(6):  # successful sign-ins do not use up the address's budget
        assert client.post(LOGIN, data={"username": "alice",
                                        "password": "alice-password"}).status_code == 200
    codes = [client.post(LOGIN, data={"username": f"ghost{i}", "password": "nope-nope"}).status_code
             for i in range(4)]
    codes.append(client.post("/login", data={"username": "ghost4", "password": "x",
                                             "csrf_token": login_form_token(client)}).status_code)
    assert codes == [401] * 5
    r = client.post(LOGIN, data={"username": "ghost5", "password": "nope-nope"})
    assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60
    wait = int(r.headers["retry-after"])  # the message says how long to wait (trial finding)
    assert r.json()["error"]["message"] == f"too many sign-in attempts; try again in {wait} s"
    page = client.post("/login", data={"username": "alice", "password": "alice-password",
                                       "csrf_token": login_form_token(client)})
    assert page.status_code == 429 and "Too many sign-in attempts" in page.text
    assert f"try again in {page.headers['retry-after']} s." in page.text
    failed = [e for e in audit.recent(engine, 100) if e.action == "login.failed"]
    assert len(failed) == 5  # refused attempts reach neither the password check nor the log


def test_current_password_check_is_rate_limited(studio):
    c = studio(login_attempts_per_minute=3)
    csrf = sign_in(c, "alice", "alice-password")
    for _ in range(2):  # the sign-in above was cleared by its success
        r = c.post("/account/password", data={"current": "wrong-one", "password": "new-password-1",
                                              "csrf_token": csrf})
        assert r.status_code == 422 and "the current password is wrong" in r.text
    r = c.post("/account/password", data={"current": "wrong-one", "password": "new-password-1",
                                          "csrf_token": csrf})
    assert r.status_code == 422
    r = c.post("/account/password", data={"current": "alice-password", "password": "new-password-1",
                                          "csrf_token": csrf})
    assert r.status_code == 429 and "too many attempts" in r.text and r.headers["retry-after"]
    assert accounts.authenticate(c.app.state.engine, "alice", "alice-password").name == "alice"


# ---- 2, 4: caching and framing headers ----------------------------------------------------------
FRAME = {"x-frame-options": "DENY", "content-security-policy": "frame-ancestors 'none'"}


def _framing(r) -> dict[str, str]:
    return {k: r.headers.get(k) for k in FRAME}


def test_no_store_vary_and_no_framing_headers(client):
    for url in ("/login", "/setup"):  # signed out: never stored either
        r = client.get(url)
        assert r.headers["cache-control"] == "no-store" and _framing(r) == FRAME, url
    r = client.get("/static/app.css")
    assert "cache-control" not in r.headers and _framing(r) == FRAME
    r = client.get("/v1/models")
    assert r.status_code == 401 and _framing(r) == FRAME
    assert _framing(client.get("/login", headers={"Host": "evil.example"})) == FRAME

    sign_in(client, "alice", "alice-password")
    for url in ("/", "/datasets", "/account", "/api/me", "/api/runs"):
        r = client.get(url)
        assert r.status_code == 200, url
        assert r.headers["cache-control"] == "no-store" and _framing(r) == FRAME, url
    page = client.get("/")
    frag = client.get("/", headers={"HX-Request": "true"})
    assert page.headers["vary"] == frag.headers["vary"] == "HX-Request"
    r = client.get("/static/app.css")  # static files stay cacheable
    assert "cache-control" not in r.headers and _framing(r) == FRAME
    auth = bearer(client, "bob", "bob-password-1")
    r = client.get("/v1/models", headers=auth)
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    assert _framing(r) == FRAME


# ---- 12: an invalid Bearer value ----------------------------------------------------------------
def test_an_invalid_bearer_value_is_named_as_such(client):
    for url in ("/api/me", "/v1/models", "/datasets"):
        r = client.get(url, headers={"Authorization": "Bearer not-a-token"}, follow_redirects=False)
        assert r.status_code == 401 and INVALID in r.text, url
    r = client.get("/v1/models", headers={"Authorization": "Bearer wk-revoked"})
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.json()["error"]["message"] == INVALID
    r = client.get("/api/me")  # nothing sent: sign in first
    assert r.status_code == 401 and r.json()["error"]["message"].startswith("sign in first")


# ---- 3: a password change ends the other sign-ins -----------------------------------------------
def test_password_change_ends_other_sessions_and_tokens_but_not_api_keys(client):
    other = TestClient(client.app, base_url=BASE)
    sign_in(other, "alice", "alice-password")
    token = bearer(client, "alice", "alice-password")
    key = client.post("/api/keys", json={"name": "laptop"}, headers=token).json()
    key_auth = {"Authorization": f"Bearer {key['key']}"}
    bob = bearer(client, "bob", "bob-password-1")
    csrf = sign_in(client, "alice", "alice-password")

    r = client.post("/account/password", data={"current": "alice-password",
                                                "password": "alice-new-password", "csrf_token": csrf},
                    follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/account"
    page = client.get("/account")
    assert "Password changed" in page.text and "API keys are separate credentials" in page.text
    notice = page.text.split("Password changed", 1)[1].split("</div>", 1)[0]
    assert f'action="/account/keys/{key["id"]}/revoke"' in notice  # its revoke button next to it
    assert "Password changed" not in client.get("/account").text  # shown once

    assert client.get("/api/me").json()["name"] == "alice"  # this session stays
    assert other.get("/api/me").status_code == 401  # the other browser is signed out
    r = client.get("/api/me", headers=token)
    assert r.status_code == 401 and r.json()["error"]["message"] == INVALID
    assert client.get("/api/me", headers=key_auth).json()["name"] == "alice"  # keys stay
    assert client.get("/api/me", headers=bob).json()["name"] == "bob"  # others untouched
    assert bearer(client, "alice", "alice-new-password")


# ---- 11: POST-redirect-GET ------------------------------------------------------------------
def test_account_forms_redirect_and_show_the_new_key_once(client):
    other = TestClient(client.app, base_url=BASE)
    sign_in(other, "alice", "alice-password")
    csrf = sign_in(client, "alice", "alice-password")
    r = client.post("/account/keys", data={"name": "laptop", "csrf_token": csrf},
                    follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/account"
    page = client.get("/account")
    plain = re.search(r'<code id="new-key">(wk-[^<]+)</code>', page.text).group(1)
    assert client.get("/api/me", headers={"Authorization": f"Bearer {plain}"}).status_code == 200
    assert plain not in client.get("/account").text  # never again, not even on reload
    assert plain not in other.get("/account").text  # nor in the same user's other session
    assert "laptop" in client.get("/account").text

    r = client.post("/account/keys", data={"name": "", "csrf_token": csrf})  # refused: shown here
    assert r.status_code == 422 and "give the key a name" in r.text
    for url in ("/account/keys", "/account/password"):
        r = client.get(url, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/account", url
    kid = client.get("/api/keys").json()[0]["id"]
    r = client.post(f"/account/keys/{kid}/revoke", data={"csrf_token": csrf})
    assert str(r.url) == f"{BASE}/account" and "Revoked the key laptop." in r.text


def test_admin_forms_redirect_to_the_admin_page(client):
    engine = client.app.state.engine
    alice = next(u for u in accounts.list_users(engine, accounts.authenticate(engine, "admin",
                                                                              ADMIN_PW))
                 if u.name == "alice")
    member = TestClient(client.app, base_url=BASE)
    sign_in(member, "bob", "bob-password-1")
    assert member.get("/admin/users", follow_redirects=False).status_code == 403
    csrf = sign_in(client, "admin", ADMIN_PW)
    for url in ("/admin/users", f"/admin/users/{alice.id}"):
        r = client.get(url, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/admin", url
    r = client.post("/admin/users", data={"name": "erin", "password": "erin-pass-1",
                                          "role": "member", "csrf_token": csrf},
                    follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/admin"
    assert "Created erin." in client.get("/admin").text
    assert "Created erin." not in client.get("/admin").text
    r = client.post(f"/admin/users/{alice.id}", data={"action": "role", "value": "admin",
                                                      "csrf_token": csrf}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/admin"
    assert "Updated alice." in client.get("/admin").text
    assert accounts.get_user(engine, alice.id).role == "admin"
    r = client.post("/admin/users", data={"name": "erin", "password": "erin-pass-1",
                                          "role": "member", "csrf_token": csrf},
                    follow_redirects=False)
    # a refusal is post-redirect-get too, shown on the page it lands on (once)
    assert r.status_code == 303 and r.headers["location"] == "/admin#add-user"
    assert "already exists" in client.get("/admin").text
    assert "already exists" not in client.get("/admin").text


# ---- 6: the audit log ----------------------------------------------------------------------
def _audit_rows(html: str) -> list[list[str]]:
    table = html.split('<table class="audit">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]
    return [[re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            for row in rows]


def test_admin_audit_log_filters_pages_and_names(client):
    engine = client.app.state.engine
    admin = accounts.authenticate(engine, "admin", ADMIN_PW)
    alice = accounts.authenticate(engine, "alice", "alice-password")
    for i in range(60):
        audit.record(engine, alice.id, "run.created", "run", f"run-{i:03d}", n=i)
    audit.record(engine, admin.id, "key.revoked", "api_key", "key-1", owner=alice.id)
    for i in range(3):
        audit.record(engine, None, "login.failed", "user", None, name=f"ghost{i}")
    sign_in(client, "admin", ADMIN_PW)

    first = client.get("/admin")
    rows = _audit_rows(first.text)
    total = len(audit.recent(engine, 1000))
    assert len(rows) == 50 and 50 < total < 100
    assert [r[1:3] for r in rows[:5]] == [["admin", "login.succeeded"]] + \
        [["—", "login.failed"]] * 3 + [["admin", "key.revoked"]]  # newest first
    assert rows[4][3:] == ["api_key key-1", "owner: alice"]  # user names, not ids
    assert rows[5][1:] == ["alice", "run.created", "run run-059", "n: 59"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", rows[0][0])
    assert '<td class="nowrap">' in first.text  # timestamps stay on one line
    older = re.search(r'href="(/admin\?before=\d+#audit)"', first.text).group(1)
    second = client.get(older)
    rows2 = _audit_rows(second.text)
    assert len(rows2) == total - 50 and rows2[-1][2] == "user.created"  # the very first event
    assert "Newer" in second.text and "Older" not in second.text
    newer = re.search(r'href="(/admin\?after=\d+#audit)"', second.text).group(1)
    assert _audit_rows(client.get(newer).text) == rows

    runs = client.get("/admin", params={"user": alice.id, "action": "run."})
    rows = _audit_rows(runs.text)
    assert len(rows) == 50 and {r[1] for r in rows} == {"alice"}
    assert [r[4] for r in rows[:2]] == ["n: 59", "n: 58"]
    nxt = re.search(r'href="(/admin\?[^"]*before=\d+#audit)"', runs.text).group(1)
    assert "user=" in nxt and "action=run." in nxt  # paging keeps the filters
    rest = _audit_rows(client.get(nxt.replace("&amp;", "&")).text)
    assert "Newer" in client.get(nxt.replace("&amp;", "&")).text
    assert [r[4] for r in rest] == [f"n: {i}" for i in range(9, -1, -1)]

    anon = _audit_rows(client.get("/admin", params={"user": audit.ANONYMOUS,
                                                    "action": "login.f"}).text)
    assert [(r[1], r[4]) for r in anon] == [("—", f"name: ghost{i}") for i in (2, 1, 0)]
    none = client.get("/admin", params={"action": "%"})  # taken literally, not as a wildcard
    assert "No event matches." in none.text


# ---- 16: navigation ------------------------------------------------------------------------
def test_signed_out_pages_hide_the_app_navigation_and_sign_out_is_one_link(client):
    for url in ("/login",):
        text = client.get(url).text
        assert 'href="/runs/new"' not in text and 'href="/datasets"' not in text
        assert "Sign out" not in text
    sign_in(client, "alice", "alice-password")
    page = client.get("/account").text
    # one Sign out (the header's); the Sessions card's "Sign out all other sessions" is another action
    assert page.count(">Sign out<") == 1 and page.count("Sign out") == 2
    assert re.search(r'<button type="submit" class="linklike">Sign out</button>', page)
    assert 'href="/runs/new"' in page


def test_a_disabled_members_browser_is_told_why_at_the_sign_in_page(client):
    """Trial s27: a disabled member's open browser was sent to the sign-in page with no reason;
    only typing the password again said the account was disabled."""
    engine = client.app.state.engine
    admin = accounts.authenticate(engine, "admin", ADMIN_PW)
    alice = TestClient(client.app, base_url=BASE)
    sign_in(alice, "alice", "alice-password")
    alice_id = accounts.authenticate(engine, "alice", "alice-password").id
    r = alice.get("/runs/new", follow_redirects=False)
    assert r.status_code == 200
    accounts.set_disabled(engine, admin, alice_id, True)
    r = alice.get("/runs/new")  # the redirect to the sign-in page, followed
    assert r.status_code == 200 and r.url.path == "/login"
    assert "this account is disabled; ask an admin" in r.text
    accounts.set_disabled(engine, admin, alice_id, False)
    page = alice.get("/login").text  # the old session ended at re-enabling: no reason to give
    assert "this account is disabled" not in page and 'name="password"' in page
