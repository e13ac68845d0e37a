"""Deleting a dataset that queued or running runs use is refused in the names a user knows
(trial s21 F9: "dataset 'file-98f8…' is used by fine-tuning job 'ftjob-171c…'" named ids, and
one run of eight): the file name and the runs by name, with their count and their jobs' states;
another user's run is counted, never named; an export or playground session does not hold it. Every surface (page, /api, /v1) says the same
(app.studio.datasets.in_use_message). Runs that ended do not keep it:
test_dataset_delete_after_runs.py."""
from __future__ import annotations

from app.store import repo
from app.store.specs import TrainSpec
from tests.web.conftest import signed_in, upload_sft

MODEL = "model-stories260K"


def _run(engine, ds: str, owner: str, name: str) -> None:
    repo.create_run(engine, TrainSpec(model=MODEL, dataset=ds, max_steps=3), name=name,
                    owner=owner)


def _refusals(c, ds: str) -> list[str]:
    """The refusal of deleting ``ds`` on the page, /api and /v1 (each a 409, the same words)."""
    page = c.post(f"/datasets/{ds}/delete", headers={"HX-Request": "true"})
    api = c.delete(f"/api/datasets/{ds}")
    v1 = c.delete(f"/v1/files/{ds}")
    assert (page.status_code, api.status_code, v1.status_code) == (409, 409, 409)
    assert api.json()["error"]["code"] == v1.json()["error"]["code"] == "file_in_use"
    msg = api.json()["error"]["message"]
    assert v1.json()["error"]["message"] == msg
    assert msg.replace("'", "&#39;") in page.text, page.text
    return msg


def test_a_dataset_in_use_names_its_file_and_runs(app, client, engine) -> None:
    alice = client.post("/api/users", json={"name": "alice",
                                            "password": "member-password-1"}).json()["id"]
    admin = client.get("/api/me").json()["id"]
    with signed_in(app, "alice", "member-password-1") as c:
        ds = upload_sft(c)
        _run(engine, ds, alice, "alice-first")
        assert _refusals(c, ds) == ("identity_alpaca.json is used by run alice-first, whose "
                                    "training job is queued: delete it once that has ended (or "
                                    "cancel it)")
        for i in range(2):
            _run(engine, ds, alice, f"alice-{i}")
        q = "training job queued"
        assert _refusals(c, ds) == (f"identity_alpaca.json is used by alice-first ({q}), "
                                    f"alice-0 ({q}) and alice-1 ({q}): delete it once those "
                                    "have ended (or cancel them)")
        _run(engine, ds, admin, "admins-secret-run")  # an admin may train on her upload
        msg = _refusals(c, ds)
        assert msg == (f"identity_alpaca.json is used by alice-first ({q}), alice-0 ({q}), "
                       f"alice-1 ({q}) and 1 run of other users: delete it once those have "
                       "ended (or cancel them)")
        assert ds not in msg and "ftjob-" not in msg and "admins-secret" not in msg
        # the admin sees every run: none is another user's to them
        assert _refusals(client, ds) == (
            f"identity_alpaca.json is used by alice-first ({q}), alice-0 ({q}), alice-1 ({q}) "
            f"and admins-secret-run ({q}): delete it once those have ended (or cancel them)")
        # a dataset only another user's run trains on
        other = upload_sft(c, "alpaca_en_demo.json")
        _run(engine, other, admin, "admins-run")
        assert _refusals(c, other) == ("alpaca_en_demo.json is used by another user's run, "
                                       "whose training job is queued: delete it once that has "
                                       "ended (or cancel it)")
