"""Every path that queues a GPU job for a user applies the GPU memory quota as run creation does
(trial: with alice's "GPU memory at once" at 0.3 GiB, a resume, a Playground session and a
/v1 chat queued jobs that could never start; the page waited forever): a resume, a checkpoint
eval and a Playground session (page API and /v1) are refused with ``over_gpu_memory_quota``,
naming the need and the quota, and queue nothing."""
from __future__ import annotations

from contextlib import contextmanager

from markupsafe import escape

from sqlmodel import func, select

from app.store import queue, repo
from app.store.db import session_scope
from app.store.schema import Job, JobState
from app.store.specs import TrainSpec
from tests.web.conftest import run_validations, signed_in
from tests.web.test_export_checkpoint import _cancel, _checkpoint
from tests.web.test_gpu_memory_quota import _quota
from tests.web.test_vram_web import _llama
from tests.web.test_web_runs import _upload

PROMPT = [{"role": "user", "content": "Hello"}]
QUOTA = "more than your GPU memory quota of 0.3 GiB at once: it could never start"


def _jobs(engine) -> int:
    with session_scope(engine) as s:
        return s.exec(select(func.count()).select_from(Job)).one()


def _refused(r, status: int = 422) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == "over_gpu_memory_quota" and QUOTA in err["message"], err
    return err["message"]


def alices_cancelled_run(app, c, engine, settings, alice: str):
    """``(model id, run, job)``: alice's (signed in as ``c``) cancelled run of an 8B-shaped
    model (an eval and a session have an estimate), with a held-out set and checkpoint-2, whose
    job needs 0.06 x 1.25 + 0.5 = 0.58 GiB."""
    ds = _upload(c, validate=False)
    run_validations(app)
    model = _llama(engine).id
    run, job = repo.create_run(engine, TrainSpec(model=model, dataset=ds, max_steps=10,
                                                 save_steps=2, validation_split_percentage=10),
                               owner=alice, estimate_gib=0.06)
    assert queue.claim(engine, "w-test", 30, kinds=["train"]).id == job.id
    _checkpoint(engine, settings, run.id, job.id, 2)
    _cancel(engine, job.id)
    return model, run, job


@contextmanager
def alice_and_her_cancelled_run(app, client, engine, settings):
    """``(c, alice's id, run)``: a new member alice, signed in as ``c``, with
    :func:`alices_cancelled_run`'s run."""
    alice = client.post("/api/users", json={"name": "alice",
                                            "password": "member-password-1"}).json()["id"]
    with signed_in(app, "alice", "member-password-1") as c:
        yield c, alice, alices_cancelled_run(app, c, engine, settings, alice)[1]


def test_resume_eval_and_playground_refuse_a_job_over_the_gpu_memory_quota(
        app, client, engine, settings) -> None:
    alice = client.post("/api/users", json={"name": "alice",
                                            "password": "member-password-1"}).json()["id"]
    with signed_in(app, "alice", "member-password-1") as c:
        model, run, job = alices_cancelled_run(app, c, engine, settings, alice)
        _quota(client, alice, "0.3")
        before = _jobs(engine)

        msg = _refused(c.post(f"/api/runs/{run.id}/resume"))
        assert msg.startswith(f"the resumed job of run {run.id} needs about 0.57 GiB of GPU "
                              "memory at once (estimate 0.06 GiB, plus the 25% admission margin")
        assert msg.endswith("Ask an admin to raise your quota (GPU memory at once, on the "
                            "Admin page).")
        # the page's button: back to the run page (post-redirect-get), where the disabled
        # button's reason says it (once: tests/web/test_refusal_said_once.py)
        page = c.post(f"/runs/{run.id}/resume", follow_redirects=False)
        assert page.status_code == 303 and page.headers["location"] == f"/runs/{run.id}"
        assert f'id="resume-why">Cannot resume: {escape(msg)}</p>' in c.get(f"/runs/{run.id}").text

        msg = _refused(c.post(f"/api/runs/{run.id}/checkpoints/2/evaluations", json={}))
        assert msg.startswith("this evaluation of checkpoint 2 needs about ")
        card = c.post(f"/runs/{run.id}/checkpoints/2/evaluate", data={},
                      headers={"HX-Request": "true"})
        assert card.status_code == 422 and QUOTA in card.text

        msg = _refused(c.post("/api/playground/sessions", json={"model": model}))
        assert msg.startswith(f"a Playground session of {model} needs about ")
        _refused(c.post("/v1/chat/completions", json={"model": model, "messages": PROMPT}),
                 400)
        assert _jobs(engine) == before  # nothing queued
        assert repo.get_run(engine, run.id).job_id == job.id
        assert queue.get_job(engine, job.id).state == JobState.CANCELLED

        # an admin resuming alice's run is told it is alice's quota
        r = client.post(f"/api/runs/{run.id}/resume")
        assert r.status_code == 422 and r.json()["error"]["code"] == "over_gpu_memory_quota"
        assert "more than alice's GPU memory quota of 0.3 GiB" in r.json()["error"]["message"]
        assert "Ask an admin to raise alice's quota" in r.json()["error"]["message"]

        # within the quota each is queued as before
        _quota(client, alice, "100")
        assert c.post(f"/api/runs/{run.id}/resume").status_code == 200
        r = c.post("/api/playground/sessions", json={"model": model})
        assert r.status_code == 201, r.text
        assert _jobs(engine) == before + 2
        # a session that started before the quota was lowered keeps serving its owner
        assert queue.claim(engine, "w-test", 30, kinds=["playground"]).id == r.json()["id"]
        _quota(client, alice, "0.3")
        again = c.post("/api/playground/sessions", json={"model": model})
        assert again.status_code == 200 and again.json()["id"] == r.json()["id"], again.text
