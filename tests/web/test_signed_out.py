"""A browser whose session ended elsewhere keeps its page: htmx requests get an in-page "you were
signed out" message (never a navigation that discards a half-filled form), and sign-in returns
to the page, never to a fragment or POST endpoint (which answered "Method Not Allowed")."""
from __future__ import annotations

from fastapi.testclient import TestClient

from tests.web.test_web_browser import browser_page, sign_out_elsewhere

PAGE = "http://127.0.0.1/runs/new"


def _anonymous(client) -> TestClient:
    return TestClient(client.app, base_url="http://127.0.0.1")


def test_htmx_requests_get_a_message_for_the_page_not_a_redirect(client):
    anon = _anonymous(client)
    r = anon.post("/runs/new/estimate", data={"r": "32"}, follow_redirects=False,
                  headers={"HX-Request": "true", "HX-Current-URL": PAGE + "?clone=x"})
    assert r.status_code == 401 and "hx-redirect" not in r.headers
    assert r.headers["hx-retarget"] == "#session-alert" and r.headers["hx-reswap"] == "innerHTML"
    assert r.headers["hx-reselect"] == "#signed-out"
    assert "You were signed out" in r.text and "then retry" in r.text
    assert 'href="/login?next=%2Fruns%2Fnew%3Fclone%3Dx" target="_blank"' in r.text
    # another site's page as the "current URL" is not a place to return to
    r = anon.get("/", headers={"HX-Request": "true", "HX-Current-URL": "http://evil.test/x"})
    assert 'href="/login?next=%2F"' in r.text


def test_a_form_post_returns_to_the_page_that_sent_it(client):
    anon = _anonymous(client)
    r = anon.post("/runs", data={"name": "x"}, headers={"Referer": PAGE}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login?next=%2Fruns%2Fnew"
    r = anon.post("/runs", data={"name": "x"}, follow_redirects=False)
    assert r.headers["location"] == "/login?next=%2F"  # unknown page: the runs list
    r = anon.get("/datasets?x=1", follow_redirects=False)  # a page: itself
    assert r.headers["location"] == "/login?next=%2Fdatasets%3Fx%3D1"


def test_signing_out_in_another_tab_keeps_the_form(server):
    from playwright.sync_api import expect

    with browser_page(server) as page:
        page.goto(f"{page.base}/runs/new")
        page.fill("#run_form input[name=name]", "half-filled")
        sign_out_elsewhere(page)
        page.fill("#run_form input[name=r]", "32")
        page.dispatch_event("#run_form input[name=r]", "change")  # the live memory estimate
        alert = page.locator("#session-alert #signed-out")
        expect(alert).to_contain_text("You were signed out")
        assert page.url == f"{page.base}/runs/new"
        expect(page.locator("#run_form input[name=name]")).to_have_value("half-filled")
        expect(page.locator("#run_form input[name=r]")).to_have_value("32")
        # the link signs in elsewhere and comes back to the page, which a GET can show
        assert alert.locator("a").get_attribute("href") == "/login?next=%2Fruns%2Fnew"


def test_a_live_run_page_says_so_when_signed_out_elsewhere(server, app, client):
    """Trial finding: the run page's live stream got a 401 and the page sat at "running, Step —"
    with no word. The stream ends within its re-check; the page shows the signed-out message."""
    from playwright.sync_api import expect

    from app.store import queue
    from tests.web.test_web_exports import _queued_run

    engine = app.state.engine
    run_id = _queued_run(client, engine)
    queue.claim(engine, "w-test", 300, kinds=["train"])  # running: the stream stays open
    with browser_page(server) as page:
        page.goto(f"{page.base}/runs/{run_id}")
        sign_out_elsewhere(page)
        alert = page.locator("#session-alert #signed-out")
        expect(alert).to_contain_text("You were signed out", timeout=30_000)
        assert alert.locator("a").get_attribute("href") == f"/login?next=%2Fruns%2F{run_id}"
