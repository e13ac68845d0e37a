"""The browser shows what the server renders for 4xx answers (htmx 2 swaps none by default).

A real headless Chromium (Debian's package) against the app served by uvicorn on a loopback
port and a temporary data dir; skipped when chromium or Playwright is missing.
"""
from __future__ import annotations

import contextlib
import re
import shutil

import pytest

from tests.conftest import SHARED_DATA as SHARED
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, run_validations

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")]


@contextlib.contextmanager
def browser_page(base: str):
    """A headless Chromium page signed in as the admin on the studio at ``base`` (its
    ``.base``); no page error may have occurred when the block ends."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = browser.new_page()
        pg.set_default_timeout(20_000)
        pg.base = base
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(f"{base}/datasets")  # signed out: the sign-in page, then back here
        pg.fill("input[name=username]", ADMIN_USER)
        pg.fill("input[name=password]", ADMIN_PASSWORD)
        pg.click("form[action='/login'] button[type=submit]")
        pg.wait_for_url(f"{base}/datasets")
        yield pg
        browser.close()
        assert not errors, errors


@pytest.fixture
def page(server):
    with browser_page(server) as pg:
        yield pg


def test_validation_errors_are_visible_in_the_browser(page, client, app):
    from playwright.sync_api import expect

    # an upload the dataset layer rejects (400): the reason appears under the form
    # an upload the dataset layer rejects: validated in the background (this test has no worker:
    # run_validations runs the job), then the dataset's page says why, by row and field
    page.goto(f"{page.base}/datasets")
    page.set_input_files("#upload_form input[type=file]",
                         str(SHARED / "messy" / "sharegpt_empty_assistant_turn.json"))
    page.click("#upload_form button[type=submit]")
    page.wait_for_url("**/datasets/file-*")
    assert run_validations(app) == 1
    page.reload()
    expect(page.locator("#report .alert.error")).to_contain_text(
        "row 1, field 'conversations[1].value': empty assistant turn")

    # a good upload, then a run form without target modules (422): the field says why
    page.goto(f"{page.base}/datasets")
    page.set_input_files("#upload_form input[type=file]", str(SHARED / "sft" / "alpaca_en_demo.json"))
    page.click("#upload_form button[type=submit]")
    page.wait_for_url("**/datasets/file-*")
    assert run_validations(app) == 1
    page.reload()
    dataset_url = page.url
    # the report selector: Enter in max_seq_length recomputes the report through htmx (a
    # value out of bounds gets the server's message: tests/web/test_dataset_ux.py)
    page.fill("#report_form input[name=max_seq_length]", "64")
    page.press("#report_form input[name=max_seq_length]", "Enter")
    expect(page.locator("#train-link")).to_have_attribute("href", re.compile("max_seq_length=64"))
    expect(page.locator("#report")).to_contain_text("Over max_seq_length (64)")
    assert page.url == dataset_url
    page.goto(f"{page.base}/runs/new")
    for box in page.locator("input[name=target_modules]").all():
        box.uncheck()
    page.click("#run_form button[type=submit]")
    expect(page.locator("#run_form fieldset.invalid .field-error")).to_contain_text(
        "name at least one module, e.g. q_proj")
    expect(page.locator("#run_form button[type=submit]")).to_be_enabled()
    assert page.url.endswith("/runs/new")

    # an error that is not a form's (404 here) shows the friendly error card in the page
    page.evaluate("() => htmx.ajax('GET', '/datasets/file-nope', {target: '#run_form'})")
    expect(page.locator("main .error-page")).to_contain_text("no dataset with id")


@pytest.fixture
def evil_site(tmp_path):
    """Another local origin (its own port) serving the pages under ``tmp_path/evil``."""
    import functools
    import http.server
    import threading

    root = tmp_path / "evil"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_a_page_from_another_origin_cannot_cancel_or_create_runs(page, client, evil_site):
    """The signed-in browser visits a page of another local origin that posts forms and fetches
    to the studio (its session cookie goes along: same site, other port). The CSRF token and
    Origin checks refuse every request; the studio's own page still cancels."""
    from app.store import queue, repo

    with (SHARED / "sft" / "alpaca_en_demo.json").open("rb") as fh:
        ds = client.post("/v1/files", files={"file": ("a.json", fh)}, data={"purpose": "fine-tune"})
    assert run_validations(client.app) == 1
    run = client.post("/api/runs", json={"model": "stories260K", "dataset": ds.json()["id"],
                                         "max_steps": 5}).json()
    root, evil = evil_site
    target = page.base
    (root / "attack.html").write_text(f"""<!doctype html><body>
<iframe name="sink"></iframe>
<form id="cancel" method="post" action="{target}/runs/{run['id']}/cancel" target="sink"></form>
<form id="create" method="post" action="{target}/runs" target="sink">
  <input name="model" value="stories260K"><input name="dataset" value="{ds.json()['id']}">
  <input name="max_steps" value="3"><input name="target_modules" value="q_proj">
</form>
<script>
  document.getElementById('cancel').submit();
  setTimeout(() => document.getElementById('create').submit(), 300);
  fetch('{target}/api/runs/{run['id']}/cancel', {{method: 'POST', credentials: 'include'}})
    .catch(() => {{}}).finally(() => {{ document.title = 'sent'; }});
</script></body>""")
    page.goto(f"{evil}/attack.html")
    page.wait_for_function("document.title === 'sent'")
    page.wait_for_timeout(1500)  # both form posts have had time to land
    engine = client.app.state.engine
    job = queue.get_job(engine, repo.get_run(engine, run["id"]).job_id)
    assert not job.cancel_requested and job.state == "queued"
    assert [r.id for r in repo.list_runs(engine)] == [run["id"]]  # nothing was created

    # the same cancel from the studio's own page (token in the form) goes through
    page.goto(f"{target}/runs/{run['id']}")
    page.once("dialog", lambda d: d.accept())
    with page.expect_response(lambda r: r.url.endswith(f"/runs/{run['id']}/cancel")
                              and r.request.method == "POST") as answer:
        page.click("#controls button")  # waits for the POST's answer, not a fixed 500 ms (slow CI)
    assert answer.value.status < 400, answer.value.status
    assert queue.get_job(engine, job.id).cancel_requested


def test_a_page_from_another_origin_cannot_sign_the_visitor_in(server, client, evil_site):
    """Login CSRF: a signed-out visitor (who has opened the sign-in page, so holds its token
    cookie) lands on another origin's page that posts the attacker's credentials to /login;
    the visitor stays signed out, and the studio's own sign-in form still works."""
    from app.studio import accounts

    sync_api = pytest.importorskip("playwright.sync_api")
    engine = client.app.state.engine
    accounts.create_user(engine, "mallory", "mallory-password",
                         actor=accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD))
    root, evil = evil_site
    (root / "login.html").write_text(f"""<!doctype html><body>
<iframe name="sink" onload="if (this.dataset.sent) document.title = 'sent'"></iframe>
<form id="f" method="post" action="{server}/login" target="sink">
  <input name="username" value="mallory"><input name="password" value="mallory-password">
</form>
<script>document.querySelector('iframe').dataset.sent = 1; document.getElementById('f').submit();
</script></body>""")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = browser.new_page()
        pg.set_default_timeout(20_000)
        pg.goto(f"{server}/login")
        pg.goto(f"{evil}/login.html")
        pg.wait_for_function("document.title === 'sent'")
        assert pg.context.request.get(f"{server}/api/me").status == 401
        assert "whetstone_session" not in {c["name"] for c in pg.context.cookies()}
        pg.goto(f"{server}/login?next=/account")
        pg.fill("input[name=username]", "mallory")
        pg.fill("input[name=password]", "mallory-password")
        pg.click("form[action='/login'] button[type=submit]")
        pg.wait_for_url(f"{server}/account")
        assert pg.context.request.get(f"{server}/api/me").json()["name"] == "mallory"
        browser.close()


def test_back_shows_whole_pages_never_a_fragment_or_a_signed_out_key(page, client, app):
    """The run page's script swaps fragments fetched from the page's own URL; Back from another
    page shows the whole run page again (``Vary: HX-Request``, ``no-store``). After signing out,
    Back shows the sign-in page, not the account page with the key just created."""
    from playwright.sync_api import expect

    from tests.web.conftest import run_validations

    with (SHARED / "sft" / "alpaca_en_demo.json").open("rb") as fh:
        ds = client.post("/v1/files", files={"file": ("a.json", fh)}, data={"purpose": "fine-tune"})
    run_validations(app)
    run = client.post("/api/runs", json={"model": "stories260K", "dataset": ds.json()["id"],
                                         "max_steps": 5}).json()
    url = f"{page.base}/runs/{run['id']}"
    fetched = []  # the end event re-renders the cards from one fetch of the page's own URL
    page.on("request", lambda r: r.url == url and r.resource_type == "fetch"
            and fetched.append(r))
    page.goto(url)  # queued: its cards follow the run's end (a page rendered ended does not)
    expect(page.locator("#m-state")).to_have_text("queued")
    assert client.post(f"/api/runs/{run['id']}/cancel").status_code == 200  # its events end
    page.wait_for_function("() => document.querySelector('#m-state').textContent === 'cancelled'")
    expect(page.locator("#controls #delete-run")).to_be_visible()  # the cards were re-rendered
    assert fetched  # from a request of the page's own URL
    page.goto(f"{page.base}/datasets")
    page.go_back()
    assert page.url == url
    expect(page.locator("header.topbar")).to_have_count(1)
    expect(page.locator("#run")).to_have_count(1)
    expect(page.locator("#m-state")).to_have_text("cancelled")

    page.goto(f"{page.base}/account")
    page.fill("form[action='/account/keys'] input[name=name]", "laptop")
    page.click("form[action='/account/keys'] button[type=submit]")
    key = page.locator("#new-key").inner_text()
    assert key.startswith("wk-") and page.url == f"{page.base}/account"
    sign_out = page.locator("header button:has-text('Sign out')")
    expect(page.get_by_role("button", name="Sign out", exact=True)).to_have_count(1)
    assert sign_out.evaluate("b => getComputedStyle(b).backgroundColor") == "rgba(0, 0, 0, 0)"
    sign_out.click()
    page.wait_for_url(f"{page.base}/login")
    page.go_back()
    expect(page.locator("form[action='/login']")).to_have_count(1)
    assert page.url.startswith(f"{page.base}/login")
    assert key not in page.content()
    expect(page.locator("header nav a[href='/runs/new']")).to_have_count(0)  # signed out: no app nav


def test_admin_role_select_shows_its_whole_value(page, client):
    # the admin's own row has no role select (you cannot demote yourself): a member's row has one
    assert client.post("/api/users", json={"name": "rosa", "password": "member-password-1"}).status_code == 201
    page.goto(f"{page.base}/admin")
    select = page.locator("td select[name=value]").first
    width, text = select.evaluate("""el => {
        const s = document.createElement('span');
        s.style.font = getComputedStyle(el).font;
        s.textContent = 'member';
        document.body.append(s);
        const w = s.getBoundingClientRect().width;
        s.remove();
        return [el.getBoundingClientRect().width, w];
    }""")
    assert width >= text + 32, (width, text)  # the text plus padding and the arrow


def test_the_memory_estimate_asks_once_per_change(page):
    """The run forms' GPU-memory panel asks the server once on load and once per change, never in
    a loop (a re-rendered panel carrying its own load trigger asked forever), and replaces only
    itself (it inherited the form's hx-target and replaced the whole form)."""
    asked: list[str] = []
    errors: list[str] = []  # the form's hx-disabled-elt, inherited by the panel, found no button
    page.on("request", lambda r: asked.append(r.url) if r.url.endswith("/estimate") else None)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(f"{page.base}/runs/new")
    page.wait_for_timeout(2500)
    assert len(asked) == 1, asked
    page.fill("#run_form input[name=r]", "32")
    page.press("#run_form input[name=r]", "Tab")  # a change event
    page.wait_for_timeout(2500)
    assert len(asked) == 2, asked
    # the panel swapped itself, not the form around it (hx-target is inherited in htmx)
    assert page.locator("#run_form #memory-estimate").count() == 1
    page.goto(f"{page.base}/runs/new/grpo")
    page.wait_for_timeout(2000)
    assert page.locator("#grpo_form #memory-estimate").count() == 1 and len(asked) == 3
    assert not [e for e in errors if "hx-disabled-elt" in e], errors


def sign_out_elsewhere(page) -> None:
    """"Sign out" in another tab: the same POST /logout with this browser's cookie (its answer,
    after the 303, is the sign-in page)."""
    status = page.evaluate("""() => fetch('/logout', {method: 'POST', headers: {
        'X-CSRF-Token': document.querySelector('meta[name=csrf-token]').content}})
        .then((r) => r.status)""")
    assert status == 200
