"""The GETs a user or client naturally tries answer rather than 405 (trial s21 F1, F10):
``/runs`` (the runs list lives at ``/``) sends to the dashboard; ``GET /api/models/{id}`` is
the model as ``GET /api/models`` lists it; ``GET /api/playground/sessions`` lists the caller's
sessions (an admin's: everyone's, as ``/api/runs``), each as ``GET .../sessions/{id}``
answers it."""
from __future__ import annotations

from app.store import repo
from app.store.schema import Model
from tests.web.conftest import signed_in
from tests.web.test_vram_web import _llama


def _member(client, name: str) -> str:
    r = client.post("/api/users", json={"name": name, "password": "member-password-1"})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_runs_sends_to_the_dashboard(client) -> None:
    r = client.get("/runs", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/"
    page = client.get("/runs")
    assert page.status_code == 200 and page.url.path == "/" and 'id="runs"' in page.text


def test_get_one_model_is_its_list_entry(app, client, engine) -> None:
    alice = _member(client, "alice")
    shared = _llama(engine)
    hers = repo.add_model(engine, Model(name="alice-local", source="local",
                                        source_ref="/srv/models/alice", status="ready",
                                        owner=alice), import_job=False)
    admins = repo.add_model(engine, Model(name="admin-private", source="local",
                                          source_ref="/srv/models/admin", status="ready",
                                          owner=None), import_job=False)
    with signed_in(app, "alice", "member-password-1") as c:
        listed = {m["id"]: m for m in c.get("/api/models").json()["data"]}
        assert set(listed) == {"model-stories260K", shared.id, hers.id}
        for model_id, entry in listed.items():
            r = c.get(f"/api/models/{model_id}")
            assert r.status_code == 200 and r.json() == entry, r.text
        assert listed[hers.id]["source_ref"] == "/srv/models/alice"
        for other in (admins.id, "model-nope"):  # an admin's own model; an unknown id
            r = c.get(f"/api/models/{other}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    # the admin sees every model, each as listed
    listed = {m["id"]: m for m in client.get("/api/models").json()["data"]}
    assert client.get(f"/api/models/{hers.id}").json() == listed[hers.id]
    assert client.get(f"/api/models/{admins.id}").json()["source_ref"] == "/srv/models/admin"


def test_list_playground_sessions(app, client, engine) -> None:
    _member(client, "alice"), _member(client, "bob")
    model = _llama(engine).id
    with signed_in(app, "alice", "member-password-1") as alice, \
            signed_in(app, "bob", "member-password-1") as bob:
        mine = alice.post("/api/playground/sessions", json={"model": model})
        assert mine.status_code == 201, mine.text
        bobs = bob.post("/api/playground/sessions", json={"model": model}).json()["id"]
        admins = client.post("/api/playground/sessions", json={"model": model}).json()["id"]
        r = alice.get("/api/playground/sessions")
        assert r.status_code == 200, r.text
        one = alice.get(f"/api/playground/sessions/{mine.json()['id']}").json()
        assert r.json() == {"object": "list", "data": [one]}
        assert [s["id"] for s in bob.get("/api/playground/sessions").json()["data"]] == [bobs]
        # an admin lists everyone's, as /api/runs does; newest first; limit as every list
        everyone = client.get("/api/playground/sessions").json()["data"]
        assert [s["id"] for s in everyone] == [admins, bobs, mine.json()["id"]]
        assert everyone[2] == one
        page = client.get("/api/playground/sessions?limit=2").json()["data"]
        assert [s["id"] for s in page] == [admins, bobs]
        r = alice.get("/api/playground/sessions?limit=0")
        assert r.status_code == 422 and r.json()["error"]["param"] == "limit", r.text
