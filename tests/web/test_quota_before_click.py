"""The run page says before the click that a resume or a checkpoint eval cannot start under the
owner's GPU memory quota (trial: with alice's "GPU memory at once" at 0.3 GiB, her run page
offered "Resume from step 2" and "Evaluate"; each click was then refused). The page and
``/api`` read the same decision the click meets (``app.studio.calibration.job_quota_refusal``):
the buttons are disabled with its words beside them, ``/api/runs/{id}`` says ``resume`` and
``/api/runs/{id}/evaluations`` each checkpoint's ``can_evaluate``, with the refusal's message
and code."""
from __future__ import annotations

import re

from markupsafe import escape

from tests.web.conftest import signed_in
from tests.web.test_gpu_memory_quota import _quota
from tests.web.test_gpu_memory_quota_everywhere import alices_cancelled_run

QUOTA_CODE = "over_gpu_memory_quota"


def _refusal(c, url: str) -> str:
    """The message of the quota refusal a click (POST ``url``) meets."""
    r = c.post(url, json={})
    assert r.status_code == 422 and r.json()["error"]["code"] == QUOTA_CODE, r.text
    return r.json()["error"]["message"]


def _button(page: str, label: str) -> str:
    """The opening tag of the button labelled ``label`` on ``page``."""
    m = re.search(rf'<button [^>]*>{label}</button>', page)
    assert m, f"no {label} button on the page"
    return m.group(0)[:-len(label) - len("</button>")]


def test_resume_and_evaluate_say_the_quota_before_the_click(app, client, engine,
                                                            settings) -> None:
    alice = client.post("/api/users", json={"name": "alice",
                                            "password": "member-password-1"}).json()["id"]
    with signed_in(app, "alice", "member-password-1") as c:
        # alice's cancelled run with checkpoint-2 and a held-out set; its job needs 0.57 GiB,
        # an eval of checkpoint-2 (an 8B base) far more
        _, run, job = alices_cancelled_run(app, c, engine, settings, alice)
        _quota(client, alice, "0.3")
        resume_msg = _refusal(c, f"/api/runs/{run.id}/resume")
        eval_msg = _refusal(c, f"/api/runs/{run.id}/checkpoints/2/evaluations")
        assert "more than your GPU memory quota of 0.3 GiB at once: it could never start" \
            in resume_msg and eval_msg.startswith("this evaluation of checkpoint 2 needs about")

        # the page: both buttons disabled, each with the refusal's own words beside it
        page = c.get(f"/runs/{run.id}").text
        assert _button(page, "Resume from step 2").endswith(
            'disabled aria-describedby="resume-why">')
        assert f'id="resume-why">Cannot resume: {str(escape(resume_msg))}</p>' in page
        assert _button(page, "Evaluate") == ('<button type="button" id="evaluate-2" disabled '
                                               'aria-describedby="evaluate-why-2">')
        assert f'id="evaluate-why-2">{str(escape(eval_msg))}</span>' in page
        assert f'action="/runs/{run.id}/checkpoints/2/evaluate"' not in page
        # /api says the same
        assert c.get(f"/api/runs/{run.id}").json()["resume"] == {
            "checkpoint_step": 2, "can_resume": False, "reason": resume_msg, "code": QUOTA_CODE}
        assert c.get(f"/api/runs/{run.id}/evaluations").json()["checkpoints"] == [
            {"step": 2, "can_evaluate": False, "reason": eval_msg, "code": QUOTA_CODE,
             "evaluation": None}]

        # an admin reading alice's run is told it is alice's quota, as the click would say
        admin_msg = _refusal(client, f"/api/runs/{run.id}/resume")
        assert "more than alice's GPU memory quota" in admin_msg
        assert client.get(f"/api/runs/{run.id}").json()["resume"]["reason"] == admin_msg
        assert str(escape(admin_msg)) in client.get(f"/runs/{run.id}").text

        # within the quota: enabled, no reason, and the click queues the job
        _quota(client, alice, "100")
        page = c.get(f"/runs/{run.id}").text
        assert "disabled" not in _button(page, "Resume from step 2")
        assert 'id="resume-why"' not in page
        assert _button(page, "Evaluate") == '<button type="submit" id="evaluate-2">'
        assert 'id="evaluate-why-2"' not in page
        assert c.get(f"/api/runs/{run.id}").json()["resume"] == {
            "checkpoint_step": 2, "can_resume": True, "reason": None, "code": None}
        assert c.get(f"/api/runs/{run.id}/evaluations").json()["checkpoints"] == [
            {"step": 2, "can_evaluate": True, "reason": None, "code": None, "evaluation": None}]
        assert c.post(f"/api/runs/{run.id}/checkpoints/2/evaluations", json={}).status_code == 202
        assert c.post(f"/api/runs/{run.id}/resume").status_code == 200
