"""An admin pauses a user (trial F12: "Jobs at once" = 0) or disables one (trial F5): every path
that queues a GPU job for them (run create on the page, /api and /v1; resume; checkpoint eval;
a Playground session, /api and /v1) refuses up front naming the quota, and queues nothing; jobs
already waiting are held by the real admission claim, the queue and run page say why, and
raising the quota / enabling the account releases them."""
from __future__ import annotations

from markupsafe import escape

from app.store import queue, workers
from app.store.admission import Slot
from app.store.schema import JobState
from tests.web.conftest import signed_in
from tests.web.test_gpu_memory_quota_everywhere import PROMPT, _jobs, alices_cancelled_run
from tests.web.test_web_runs import _form, _upload

CPU_SLOT = Slot("vm-slot", "vm", None, None, None)
PAUSED = "Jobs at once is 0 for you: ask an admin. No job of yours starts while it is"


def _jobs_at_once(client, user_id: str, jobs: str) -> str:
    r = client.post(f"/admin/quotas/{user_id}", data={"quota_jobs": jobs, "quota_gib": "",
                                                      "quota_gpu_hours": "", "share_weight": "1"},
                    headers={"HX-Request": "true"})
    assert r.status_code == 200, r.text
    return r.text


def _refused(r, code: str, text: str, status: int = 422) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and text in err["message"], err
    return err["message"]


def _member_with_runs(app, client, engine, settings, name: str):
    """``(user id, model id, cancelled run with checkpoint-2, dataset id, waiting run id)``:
    member ``name``'s runs (:func:`alices_cancelled_run`), one more created over /api."""
    uid = client.post("/api/users", json={"name": name,
                                          "password": "member-password-1"}).json()["id"]
    with signed_in(app, name, "member-password-1") as c:
        model, run, _ = alices_cancelled_run(app, c, engine, settings, uid)
        ds = _upload(c)
        r = c.post("/api/runs", json={"model": model, "dataset": ds, "max_steps": 3})
        assert r.status_code == 201, r.text
    return uid, model, run, ds, r.json()["id"]


def _admit(engine):
    workers.register(engine, CPU_SLOT.id, "vm", 1, "cpu slot (2 cores, one job at a time)")
    return queue.admit(engine, CPU_SLOT, 300, ["train", "evaluate", "playground"], 0.25, 24.0)


def test_jobs_at_once_zero_refuses_every_new_job_and_holds_the_waiting_ones(
        app, client, engine, settings) -> None:
    alice, model, run, ds, waiting = _member_with_runs(app, client, engine, settings, "alice")
    with signed_in(app, "alice", "member-password-1") as c:
        page = _jobs_at_once(client, alice, "0")  # accepted: a way to pause a user
        assert "Saved the quotas of alice." in page
        assert "Jobs at once counts training, GRPO, evaluation and playground jobs; 0 pauses " \
               "a user: they cannot start new ones, their waiting ones are held and their " \
               "running ones continue to the end (their exports, imports and dataset checks " \
               "still run; Disable holds those too)." in client.get("/admin/quotas").text
        before = _jobs(engine)

        msg = _refused(c.post("/api/runs", json={"model": model, "dataset": ds}),
                       "jobs_at_once_zero", PAUSED)
        assert msg.endswith("so this run is not queued.")
        form = c.post("/runs", data=_form(c, ds), headers={"HX-Request": "true"})
        assert form.status_code == 422 and form.text.count(PAUSED) == 1  # above it, once
        for url in ("/runs/new", "/runs/new/grpo"):  # said on the forms before Start
            assert PAUSED in c.get(url).text, url
        _refused(c.post("/v1/fine_tuning/jobs", json={"model": model, "training_file": ds}),
                 "jobs_at_once_zero", PAUSED, 400)
        # resume and evaluate: refused, and the run page's buttons say why before the click
        _refused(c.post(f"/api/runs/{run.id}/resume"), "jobs_at_once_zero", PAUSED)
        state = c.get(f"/api/runs/{run.id}").json()["resume"]
        assert state["can_resume"] is False and state["code"] == "jobs_at_once_zero"
        assert state["reason"].startswith(PAUSED)
        _refused(c.post(f"/api/runs/{run.id}/checkpoints/2/evaluations", json={}),
                 "jobs_at_once_zero", PAUSED)
        msg = _refused(c.post("/api/playground/sessions", json={"model": model}),
                       "jobs_at_once_zero", PAUSED)
        assert msg.endswith(f"so a Playground session of {model} is not queued.")
        _refused(c.post("/v1/chat/completions", json={"model": model, "messages": PROMPT}),
                 "jobs_at_once_zero", PAUSED, 400)
        assert _jobs(engine) == before  # nothing queued

        # the run created before is held by the real claim, and the queue says so plainly
        waiting_job = c.get(f"/api/runs/{waiting}").json()["job_id"]
        assert _admit(engine) is None
        (row,) = c.get("/api/queue").json()["waiting"]
        assert row["job_id"] == waiting_job
        assert row["reason"] == "held: Jobs at once is 0 for you; ask an admin"
        (row,) = client.get("/api/queue").json()["waiting"]
        assert row["reason"] == ("held: Jobs at once is 0 for alice; raising it on the Admin "
                                 "page releases the job")

    # an admin acting for alice is told it is alice's quota
    _refused(client.post(f"/api/runs/{run.id}/resume"), "jobs_at_once_zero",
             "Jobs at once is 0 for alice: raise it on the Admin page.")
    _jobs_at_once(client, alice, "1")
    assert _admit(engine).id == waiting_job


def test_a_disabled_users_waiting_jobs_are_held_and_released_when_enabled(
        app, client, engine, settings) -> None:
    bob, _, run, _, waiting = _member_with_runs(app, client, engine, settings, "bob")
    waiting_job = client.get(f"/api/runs/{waiting}").json()["job_id"]
    r = client.post(f"/admin/users/{bob}", data={"action": "disabled", "value": "true"},
                    headers={"HX-Request": "true"}, follow_redirects=False)
    assert r.status_code == 200, r.text

    assert _admit(engine) is None  # the real claim skips it, the slot free
    held = "held: bob's account is disabled; enabling it again releases the job"
    (row,) = client.get("/api/queue").json()["waiting"]
    assert (row["job_id"], row["reason"]) == (waiting_job, held)
    assert str(escape(held)) in client.get(f"/runs/{waiting}").text  # the run page (admin)
    # an admin resuming the disabled user's run is told why it is not queued
    _refused(client.post(f"/api/runs/{run.id}/resume"), "owner_disabled",
             "bob's account is disabled: enable it on the Admin page first.")

    r = client.post(f"/admin/users/{bob}", data={"action": "disabled", "value": "false"},
                    headers={"HX-Request": "true"}, follow_redirects=False)
    assert r.status_code == 200, r.text
    assert _admit(engine).id == waiting_job
    assert queue.get_job(engine, waiting_job).state == JobState.RUNNING
