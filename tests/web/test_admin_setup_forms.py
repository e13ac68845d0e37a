"""Admin and setup forms as a first user meets them: the admin's own row offers no Disable or
role change (the server refuses them anyway) but says why; a refused quota keeps the typed
values and puts each field's error by its field; the setup form and the add-user form name
every bad field at once."""
from __future__ import annotations

import html as html_lib
import re

from app.studio import accounts
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER, login_form_token

OWN = "you cannot demote or disable your own account"


def _row(page: str, uid: str) -> str:
    """The Users table row of ``uid`` (from its name cell to the row's end)."""
    start = page.rindex("<tr>", 0, page.index(f'<code class="small">{uid}</code>'))
    return page[start:page.index("</tr>", start)]


def test_own_row_has_no_disable_or_demote_but_says_why(client):
    engine = client.app.state.engine
    me = accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD)
    other = client.post("/api/users", json={"name": "ada", "password": "ada-password-1",
                                            "role": "admin"}).json()["id"]
    page = client.get("/admin").text
    mine, theirs = _row(page, me.id), _row(page, other)
    assert "Disable</button>" not in mine and 'value="role"' not in mine
    assert OWN in html_lib.unescape(mine)
    assert "Disable</button>" in theirs and 'value="role"' in theirs and OWN not in theirs
    r = client.post(f"/admin/users/{me.id}", data={"action": "disabled", "value": "true"})
    assert r.status_code == 409 and OWN in html_lib.unescape(r.text)  # the rule stays


def test_refused_quota_keeps_the_typed_values_and_errors_by_the_fields(client):
    engine = client.app.state.engine
    me = accounts.authenticate(engine, ADMIN_USER, ADMIN_PASSWORD)
    r = client.post(f"/admin/quotas/{me.id}", headers={"HX-Request": "true"},
                    data={"quota_jobs": "2", "quota_gib": "lots", "quota_gpu_hours": "-1",
                          "share_weight": "3"})
    assert r.status_code == 422
    page = html_lib.unescape(r.text)
    for name, value in (("quota_jobs", "2"), ("quota_gib", "lots"), ("quota_gpu_hours", "-1"),
                        ("share_weight", "3")):
        assert re.search(rf'name="{name}"[^>]*value="{re.escape(value)}"', page), name
    cell = page[page.index('name="quota_gib"'):]
    assert cell.index("GPU memory at once (GiB) must be a number (empty: no limit)") < cell.index("</td>")
    cell = page[page.index('name="quota_gpu_hours"'):]
    assert cell.index("GPU-hours a day must be at least 0") < cell.index("</td>")
    cell = page[page.index('name="quota_jobs"'):]
    assert "field-error" not in cell[:cell.index("</td>")]
    assert accounts.get_user(engine, me.id).quota_gib is None  # nothing saved


def test_quota_refusals_name_the_columns_the_admin_sees(client):
    """Trial: "quota_gib must be a number" named a field key; each refusal names its column as
    the table's header shows it, and the whole fragment shows no field key as text."""
    me = accounts.authenticate(client.app.state.engine, ADMIN_USER, ADMIN_PASSWORD)
    r = client.post(f"/admin/quotas/{me.id}", headers={"HX-Request": "true"},
                    data={"quota_jobs": "1.5", "quota_gib": "lots", "quota_gpu_hours": "NaN",
                          "share_weight": "0"})
    assert r.status_code == 422
    page = html_lib.unescape(r.text)
    headers = re.findall(r"<th>([^<]+)</th>", page)[1:5]
    errors = re.findall(r'<span class="field-error"[^>]*>([^<]*)</span>', page)
    assert headers == ["Jobs at once", "GPU memory at once (GiB)", "GPU-hours a day", "Weight"]
    assert errors == ["Jobs at once must be a whole number, 0 or more (empty: no limit), not 1.5",
                      "GPU memory at once (GiB) must be a number (empty: no limit)",
                      "GPU-hours a day must be a finite number (empty: no limit)",
                      "Weight must be at least 0.01"]
    text = re.sub(r"<[^>]*>", " ", page)  # what is read, not the markup's names
    assert not re.search(r"quota_|share_weight", text), text


def test_setup_shows_every_field_error_at_once(make_client, capsys):
    c = make_client()
    link = re.search(r"http://127\.0\.0\.1:8000(/setup\?token=\S+)",
                     capsys.readouterr().out).group(1)
    r = c.post("/setup", data={"token": link.split("token=")[1], "name": "", "password": "short",
                               "password2": "shorter", "csrf_token": login_form_token(c, link)})
    assert r.status_code == 422
    errors = dict(re.findall(r'<input name="(\w+)"[^>]*>\s*(?:<span class="help">[^<]*</span>\s*)?'
                             r'<span class="field-error">([^<]*)</span>', r.text))
    assert errors == {
        "name": "a user name is 1-64 letters, digits or . _ @ - and starts with a letter or digit",
        "password": "the password needs at least 8 characters",
        "password2": "the passwords differ"}


def test_add_user_names_every_bad_field(client):
    r = client.post("/admin/users", data={"name": " ", "password": "x", "role": "member"},
                    follow_redirects=False)
    assert r.status_code == 303
    page = client.get(r.headers["location"]).text
    assert {"name", "password"} <= set(re.findall(
        r'<input name="(\w+)"[^>]*>\s*<span class="field-error">', page))
    r = client.post("/api/users", json={"name": "", "password": "x"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "name"


def test_refused_add_user_redirects_and_keeps_the_typed_values_once(client):
    """Trial: reloading the page after a refused Add user asked to post the form again. The
    refusal is POST-redirect-GET: the page it lands on keeps the typed name and role (never the
    password) and shows each field's error; a reload of that page is a plain GET."""
    client.post("/api/users", json={"name": "ada", "password": "ada-password-1"})
    r = client.post("/admin/users", data={"name": "ada", "password": "hunter2-secret",
                                          "role": "admin"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/admin#add-user"
    page = html_lib.unescape(client.get("/admin").text)
    form = page[page.index('action="/admin/users"'):]
    form = form[:form.index("</form>")]
    assert re.search(r'<input name="name" value="ada"', form)
    assert re.search(r"<option selected>admin</option>", form)
    assert "hunter2-secret" not in page
    assert re.findall(r'<span class="field-error">([^<]*)</span>', form) == [
        "a user named 'ada' already exists"]
    # another spelling of a taken name names the account that holds it (trial s23 L-10)
    r = client.post("/api/users", json={"name": "ADA", "password": "ada-password-2"})
    assert r.status_code == 409 and r.json()["error"]["message"] == (
        "a user named 'ada' already exists (names ignore case: 'ADA' is 'ada')"), r.text
    r = client.post("/admin/users", data={"name": "no spaces allowed", "password": "short",
                                          "role": "member"},
                    follow_redirects=False)
    assert r.status_code == 303
    form = client.get("/admin").text.split('action="/admin/users"')[1].split("</form>")[0]
    errors = dict(re.findall(r'<input name="(\w+)"[^>]*>\s*<span class="field-error">([^<]*)<',
                             form))
    assert set(errors) == {"name", "password"} and "8 characters" in errors["password"]
    assert 'value="no spaces allowed"' in form
    assert not re.search(r'<input name="password"[^>]*value=', form)  # never sent back
    again = client.get("/admin").text  # the reload: the page, without the spent refusal
    assert "field-error" not in again and 'value="no spaces allowed"' not in again


def test_an_empty_weight_is_the_default_not_no_limit(client):
    """Trial s21 F3: "Weight must be a finite number (empty: no limit)", but an empty Weight
    saves the default weight 1, not "no limit": its refusals say what empty means for it."""
    engine = client.app.state.engine
    uid = client.post("/api/users", json={"name": "wes", "password": "wes-password-1"}).json()["id"]
    for raw, words in (("inf", "must be a finite number"), ("NaN", "must be a finite number"),
                       ("abc", "must be a number"), ("2e9", "must be at most 1000000000")):
        r = client.post(f"/admin/quotas/{uid}", headers={"HX-Request": "true"},
                        data={"quota_jobs": "", "quota_gib": "", "quota_gpu_hours": "",
                              "share_weight": raw})
        assert r.status_code == 422, raw
        errors = re.findall(r'<span class="field-error"[^>]*>([^<]*)</span>',
                            html_lib.unescape(r.text))
        assert errors == [f"Weight {words} (empty: the default, 1)"], (raw, errors)
    r = client.post(f"/admin/quotas/{uid}", headers={"HX-Request": "true"},
                    data={"quota_jobs": "", "quota_gib": "", "quota_gpu_hours": "",
                          "share_weight": "3"})
    assert r.status_code == 200
    assert accounts.get_user(engine, uid).share_weight == 3.0
    r = client.post(f"/admin/quotas/{uid}", headers={"HX-Request": "true"},
                    data={"quota_jobs": "", "quota_gib": "", "quota_gpu_hours": "",
                          "share_weight": ""})
    assert r.status_code == 200 and accounts.get_user(engine, uid).share_weight == 1.0
    assert "Empty = no limit (an empty Weight is the default, 1)." in \
        client.get("/admin/quotas").text


def test_gpu_hours_say_why_they_stay_empty_on_a_box_without_a_gpu(client, engine):
    """Trial s21 F8: on a CPU-only studio the GPU-hours table and quota silently did nothing;
    with only a CPU slot live the Admin page says why, with a GPU slot live it does not."""
    from app.store import workers

    note = "This box has no GPU: its jobs run on the CPU slot, and GPU-hours count GPU time only"
    assert note not in client.get("/admin/quotas").text  # no live worker: nothing tells
    workers.register(engine, "box-main", "box", 1, "cpu slot (2 cores, one job at a time)")
    assert note in client.get("/admin/quotas").text
    workers.register(engine, "box2:0", "box2", 2, "NVIDIA H200", gpu_capacity_gib=139.8)
    assert note not in client.get("/admin/quotas").text
