"""Every route the app registers, walked as member A (the owner), member B, an admin and anonymous.

The routes are read from the app's router, so a new route that this table does not know fails
``test_every_route_is_known``; each path parameter is filled with one of A's objects. B must get
404 on every method of every route that names one of A's objects (ids do not leak), and no list
B reads may mention A's objects; anonymous callers get 401 (JSON surfaces) or the sign-in page;
the admin gets through. Runs against a real uvicorn server with real SQLite and real files.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import httpx
import pytest
from fastapi.routing import APIRoute, iter_route_contexts

from app.store import queue, repo
from app.store.schema import Artifact
from tests.conftest import SHARED_DATA, need_shared_data
from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER
from tests.web.conftest import run_validations

#: Routes anyone may call (sign-in, first-run setup, health, the API docs).
PUBLIC = {"/login", "/logout", "/setup", "/healthz", "/api/login/access-token", "/api/docs",
          "/api/docs/oauth2-redirect", "/api/openapi.json"}
#: Path parameter -> the key of A's object in the ``objs`` fixture.
PARAMS = {"run_id": "run", "job_id": "run", "dataset_id": "dataset", "file_id": "dataset",
          "model_id": "model", "export_id": "export", "artifact_id": "artifact",
          "key_id": "key", "user_id": "user_a", "step": "step", "eval_id": "evaluation"}
#: Routes whose object is not "A's" in the ownership sense (admin-only user management: B is a
#: member and gets 403 there; A's own account pages take no id).
ADMIN_ONLY = {"/admin/users/{user_id}", "/admin", "/admin/users", "/api/users",
              "/queue/jobs/{job_id}/front", "/api/queue/jobs/{job_id}/front", "/admin/quotas",
              "/admin/quotas/{user_id}", "/admin/usage.csv"}
#: Form URLs whose GET only sends the caller to the form's page (POST-redirect-GET); ``/runs``
#: (where the run form posts) to the runs list, the dashboard.
FORM_PAGES = {"/account/keys": "/account", "/account/password": "/account", "/runs": "/",
              "/account/sessions/sign-out-others": "/account#sessions"}
#: A playground session (an integer job id) is A's too.
PARAMS["session_id"] = "session"
PARAMS["request_id"] = "request"  # a prompt of A's session


@dataclass
class Route:
    """One registered route with its full path (router prefixes included)."""

    path: str
    methods: set[str]

    @property
    def params(self) -> list[str]:
        return re.findall(r"{(\w+)(?::\w+)?}", self.path)


def api_routes(app) -> list[Route]:
    """Every APIRoute the app serves, read from its router (included routers flattened)."""
    return [Route(c.path, set(c.methods or ())) for c in iter_route_contexts(app.routes)
            if isinstance(c.route, APIRoute)]


def token(base: str, name: str, password: str) -> str:
    r = httpx.post(f"{base}/api/login/access-token", data={"username": name, "password": password})
    assert r.status_code == 200, r.text
    return r.json()["access_token"]


@pytest.fixture
def objs(app, server, engine, settings, tmp_path):
    """Members A and B (Bearer clients), the admin, and one of each of A's objects."""
    need_shared_data()
    admin = httpx.Client(base_url=server, timeout=60,
                         headers={"Authorization": f"Bearer {token(server, ADMIN_USER, ADMIN_PASSWORD)}"})
    users = {}
    for name in ("alice", "bob"):
        r = admin.post("/api/users", json={"name": name, "password": f"{name}-password-1",
                                           "role": "member"})
        assert r.status_code == 201, r.text
        users[name] = r.json()
    a = httpx.Client(base_url=server, timeout=60, headers={
        "Authorization": f"Bearer {token(server, 'alice', 'alice-password-1')}"})
    b = httpx.Client(base_url=server, timeout=60, headers={
        "Authorization": f"Bearer {token(server, 'bob', 'bob-password-1')}"})
    src = SHARED_DATA / "sft" / "alpaca_en_demo.json"
    with src.open("rb") as fh:
        r = a.post("/v1/files", files={"file": ("alpaca.json", fh)}, data={"purpose": "fine-tune"})
    assert r.status_code == 200, r.text
    dataset = r.json()["id"]
    run_validations(app)
    r = a.post("/api/models", json={"source": "hf", "hf_id": "alice/tiny-model"})
    assert r.status_code == 201, r.text
    model, model_name = r.json()["id"], r.json()["name"]
    r = a.post("/api/runs", json={"model": "stories260K", "dataset": dataset, "max_steps": 2})
    assert r.status_code == 201, r.text
    run = r.json()["id"]
    # the run's job finishes through the real queue protocol (no worker in this test)
    job = queue.claim(engine, "walker", 30, kinds=["train"])
    assert job is not None and job.run_id == run
    assert queue.finish(engine, job.id, "walker", {"trained_tokens": 10})
    r = a.post(f"/api/runs/{run}/exports", json={"format": "adapter"})
    assert r.status_code == 201, r.text
    export = r.json()["id"]
    path = settings.data_dir / "runs" / run / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"spec": {}}))
    art = repo.add_artifact(engine, Artifact(run_id=run, job_id=job.id, kind="config",
                                             name="config.json", path=str(path), bytes=12))
    ckpt = settings.data_dir / "runs" / run / "checkpoints" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    repo.add_artifact(engine, Artifact(run_id=run, job_id=job.id, kind="checkpoint",
                                       name=ckpt.name, path=str(ckpt), meta={"step": 2}))
    evaluation = queue.enqueue(engine, "evaluate", {"spec_version": 1, "run_id": run,
                                                    "checkpoint_step": 2, "samples": 1},
                               run_id=run, owner=users["alice"]["id"]).id
    r = a.post("/api/keys", json={"name": "laptop"})
    assert r.status_code == 201, r.text
    key = r.json()["id"]
    r = a.post("/api/playground/sessions", json={"model": f"stories260K:ft:{run}"})
    assert r.status_code == 201, r.text
    session = r.json()["id"]
    r = a.post(f"/api/playground/sessions/{session}/prompts",
               json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 202, r.text
    yield {"session": session, "request": r.json()["request_id"], "a": a, "b": b, "admin": admin, "anon": httpx.Client(base_url=server, timeout=60),
           "run": run, "job": job.id, "dataset": dataset, "model": model, "model_name": model_name, "export": str(export),
           "artifact": art.id, "key": key, "user_a": users["alice"]["id"],
           "step": 2, "evaluation": evaluation,
           "names": [run, dataset, model, art.id, key]}
    for c in (a, b, admin):
        c.close()


def fill(path: str, objs: dict) -> str:
    out = path
    if path.startswith("/v1/models/"):  # /v1 names base models by name
        return out.replace("{model_id}", objs["model_name"])
    if path.startswith(("/queue/", "/api/queue/")):  # the queue names its (integer) job ids
        out = out.replace("{job_id}", str(objs["job"]))
    for param, key in PARAMS.items():
        out = out.replace("{" + param + "}", str(objs[key]))
    return out


def call(client: httpx.Client, method: str, url: str) -> httpx.Response:
    """One request with a harmless body; SSE answers are read only up to their headers."""
    kwargs = {"json": {}} if method in ("POST", "PUT", "PATCH") and "/api/" in url or \
        url.startswith("/v1") and method == "POST" else ({"data": {}} if method == "POST" else {})
    with client.stream(method, url, follow_redirects=False, **kwargs) as r:
        if "text/event-stream" not in r.headers.get("content-type", ""):
            r.read()
        return r


def test_every_route_is_known(app):
    unknown = []
    for r in api_routes(app):
        for p in r.params:
            if p not in PARAMS:
                unknown.append(f"{r.path}: {{{p}}}")
    assert not unknown, ("routes with a path parameter the ownership walk cannot fill; add "
                         f"it to PARAMS (and an ownership check to its route): {unknown}")
    assert len(api_routes(app)) >= 50


def fake_ids(objs: dict) -> dict:
    """The same objects' ids with their random part zeroed: ids that exist nowhere."""
    out = dict(objs)
    for key in set(PARAMS.values()):
        real = str(objs[key])
        out[key] = "999999999" if real.isdigit() else real.rsplit("-", 1)[0] + "-" + "0" * 16
    out["model_name"] = "no-such-model"
    return out


def test_member_b_gets_404_on_every_route_naming_a_s_objects(app, objs):
    """B's answer about A's object is exactly the answer about an id that does not exist."""
    checked, fake = 0, fake_ids(objs)
    for route in api_routes(app):
        if not route.params or route.path in ADMIN_ONLY:
            continue
        for method in sorted(route.methods - {"HEAD"}):
            real_url, fake_url = fill(route.path, objs), fill(route.path, fake)
            r = call(objs["b"], method, real_url)
            assert r.status_code == 404, f"B {method} {route.path}: {r.status_code} {r.text[:200]}"
            missing = call(objs["b"], method, fake_url)
            assert missing.status_code == 404, f"B {method} {fake_url}: {missing.status_code}"
            text, other = r.text, missing.text
            for key in set(PARAMS.values()) | {"model_name"}:
                if not str(objs[key]).isdigit():
                    text = text.replace(str(objs[key]), str(fake[key]))
            if "{export_id}" in route.path or "{eval_id}" in route.path:  # small int ids:
                # compare with digits blanked
                text, other = re.sub(r"\d+", "N", text), re.sub(r"\d+", "N", other)
            assert text == other, f"B {method} {route.path}: {r.text} vs {missing.text}"
            checked += 1
    assert checked >= 25


def test_lists_show_b_none_of_a_s_objects(app, objs):
    listed = 0
    for route in api_routes(app):
        if route.params or "GET" not in route.methods or route.path in PUBLIC:
            continue
        if route.path in ADMIN_ONLY:
            r = call(objs["b"], "GET", route.path)
            assert r.status_code == 403, f"B GET {route.path}: {r.status_code}"
            continue
        r = call(objs["b"], "GET", route.path)
        if route.path in FORM_PAGES:
            assert r.status_code == 303 and r.headers["location"] == FORM_PAGES[route.path]
            continue
        assert r.status_code in (200, 204), f"B GET {route.path}: {r.status_code} {r.text[:200]}"
        for name in objs["names"]:
            assert name not in r.text, f"B GET {route.path} shows A's {name}"
        listed += 1
    assert listed >= 10
    # and A does see them where they are listed
    assert objs["run"] in objs["a"].get("/api/runs").text
    assert objs["dataset"] in objs["a"].get("/v1/files").text
    assert objs["run"] in objs["a"].get("/").text


def test_anonymous_gets_401_or_the_sign_in_page(app, objs):
    for route in api_routes(app):
        if route.path in PUBLIC:
            continue
        for method in sorted(route.methods - {"HEAD"}):
            url = fill(route.path, objs)
            r = call(objs["anon"], method, url)
            json_surface = url.startswith(("/api/", "/v1/")) or url.endswith("/events")
            if json_surface:
                assert r.status_code == 401, f"anon {method} {route.path}: {r.status_code}"
            elif method == "GET":
                assert r.status_code == 303 and r.headers["location"].startswith("/login"), \
                    f"anon GET {route.path}: {r.status_code}"
            else:  # a form post without a session: refused (401 or the CSRF check's 403)
                assert r.status_code in (303, 401, 403), f"anon {method} {route.path}: {r.status_code}"


def test_admin_gets_through_to_a_s_objects(app, objs):
    # the cancels last: a cancelled export or eval could then be deleted by a later DELETE,
    # and the routes after it would answer 404 for an object that is gone, not hidden
    for route in sorted(api_routes(app), key=lambda r: r.path.endswith("/cancel")):
        if not route.params:
            continue
        for method in sorted(route.methods - {"HEAD"}):
            if "{key_id}" in route.path:  # each revocation gets a live key of A's
                objs["key"] = objs["a"].post("/api/keys", json={"name": "another"}).json()["id"]
            r = call(objs["admin"], method, fill(route.path, objs))
            assert r.status_code not in (401, 403, 404), \
                f"admin {method} {route.path}: {r.status_code} {r.text[:200]}"


def test_no_api_response_shows_a_server_path(app, objs, settings):
    """Models, runs (with artifacts), datasets, exports and the /v1 objects never carry the data
    dir's absolute path (issue 19 item 5)."""
    root = str(settings.data_dir.resolve())
    urls = ["/api/models", "/api/runs", f"/api/runs/{objs['run']}", "/api/datasets",
            f"/api/datasets/{objs['dataset']}", f"/api/runs/{objs['run']}/exports",
            f"/api/exports/{objs['export']}", "/v1/files", f"/v1/files/{objs['dataset']}",
            "/v1/fine_tuning/jobs", f"/v1/fine_tuning/jobs/{objs['run']}", "/v1/models"]
    for url in urls:
        r = objs["a"].get(url)
        assert r.status_code == 200, (url, r.status_code)
        assert root not in r.text and str(settings.data_dir) not in r.text, url
