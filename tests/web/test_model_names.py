"""Model names belong to their owner: a private model's name neither leaks to nor blocks another
user, a name resolves to the caller's own model first, and a shared model is changed by admins
only (QA trial: one global namespace leaked and blocked names; a member got a 404 deleting the
shared demo model listed right there)."""
from __future__ import annotations

import httpx
import pytest

from tests.web.conftest import ADMIN_PASSWORD, ADMIN_USER


def _client(server: str, name: str, password: str) -> httpx.Client:
    r = httpx.post(f"{server}/api/login/access-token", data={"username": name, "password": password})
    assert r.status_code == 200, r.text
    return httpx.Client(base_url=server, timeout=30,
                        headers={"Authorization": f"Bearer {r.json()['access_token']}"})


@pytest.fixture
def team(server):
    admin = _client(server, ADMIN_USER, ADMIN_PASSWORD)
    for name in ("alice", "bob"):
        r = admin.post("/api/users", json={"name": name, "password": f"{name}-password-1",
                                           "role": "member"})
        assert r.status_code == 201, r.text
    yield {"admin": admin, "alice": _client(server, "alice", "alice-password-1"),
           "bob": _client(server, "bob", "bob-password-1")}


def test_names_are_per_owner(team):
    alice, bob = team["alice"], team["bob"]
    r = alice.post("/api/models", json={"source": "hf", "hf_id": "acme/secret-llm",
                                        "name": "secret-project"})
    assert r.status_code == 201, r.text
    # Bob learns nothing: the same name is free for him, and it is his own model he then sees
    r = bob.post("/api/models", json={"source": "hf", "hf_id": "foo/bar", "name": "secret-project"})
    assert r.status_code == 201, r.text
    assert [m["source_ref"] for m in bob.get("/api/models").json()["data"]
            if m["name"] == "secret-project"] == ["foo/bar"]
    # his own duplicate is refused, and so is the shared demo model's name
    r = alice.post("/api/models", json={"source": "hf", "hf_id": "x/y", "name": "secret-project"})
    assert r.status_code == 422 and "you already have" in r.json()["error"]["message"]
    r = alice.post("/api/models", json={"source": "hf", "hf_id": "x/y", "name": "stories260K"})
    assert r.status_code == 422 and "shared model" in r.json()["error"]["message"]
    # the admin sees both owners' models
    names = [m["name"] for m in team["admin"].get("/api/models").json()["data"]]
    assert names.count("secret-project") == 2


def test_only_an_admin_changes_the_shared_model(team, engine):
    from app.store import repo
    from app.store.seed import DEMO_MODEL_ID

    repo.update_model(engine, DEMO_MODEL_ID, status="ready")  # as its import job would
    r = team["alice"].delete("/api/models/stories260K")
    assert r.status_code == 403 and "only an admin" in r.json()["error"]["message"]
    page = team["alice"].get("/models").text
    assert "Delete model stories260K" not in page  # no button a member cannot use
    assert "Delete model stories260K" in team["admin"].get("/models").text


def test_members_see_no_server_path_and_admins_see_owners(team, settings):
    demo_ref = str(settings.seed_dir)  # the demo model's llama2.c files live there
    for who in ("alice", "bob"):
        assert demo_ref not in team[who].get("/api/models").text
        assert demo_ref not in team[who].get("/models").text
    assert demo_ref in team["admin"].get("/api/models").text
    team["alice"].post("/api/models", json={"source": "hf", "hf_id": "acme/a", "name": "mine"})
    admin_page = team["admin"].get("/models").text
    assert "<th>Owner</th>" in admin_page and "alice" in admin_page and "shared" in admin_page
    assert "<th>Owner</th>" not in team["alice"].get("/models").text
    with (settings.seed_dir / "sft" / "alpaca_en_demo.json").open("rb") as fh:
        assert team["alice"].post("/v1/files", files={"file": ("a.json", fh)},
                                  data={"purpose": "fine-tune"}).status_code == 200
    page = team["admin"].get("/datasets").text
    assert "<th>Owner</th>" in page and "<td>alice</td>" in page
    assert "<th>Owner</th>" not in team["alice"].get("/datasets").text
