"""A refused click is answered in one sentence, not two (trial s21 F2: with alice's "GPU memory
at once" lowered after her run page loaded, Resume came back with the disabled button's reason
and, right under it, a red flash with the same 60 words; Evaluate likewise on its card). The
page says a refusal it already prints beside the disabled button only there
(``app.studio.errors.said_once``); the disabled Resume button's tooltip says why it is
disabled."""
from __future__ import annotations

import re

from markupsafe import escape

from tests.web.test_gpu_memory_quota import _quota
from tests.web.test_gpu_memory_quota_everywhere import alice_and_her_cancelled_run
from tests.web.test_quota_before_click import _button, _refusal

ALERT = '<div class="alert error" role="alert">'


def test_a_refused_resume_or_evaluate_says_its_reason_once(app, client, engine,
                                                           settings) -> None:
    with alice_and_her_cancelled_run(app, client, engine, settings) as (c, alice, run):
        page = c.get(f"/runs/{run.id}").text  # loaded within the quota: Resume enabled
        assert 'title="Continue training from checkpoint-2: ' in _button(page,
                                                                         "Resume from step 2")
        _quota(client, alice, "0.3")
        resume_msg = str(escape(_refusal(c, f"/api/runs/{run.id}/resume")))
        eval_msg = str(escape(_refusal(c, f"/api/runs/{run.id}/checkpoints/2/evaluations")))

        # the Resume click (a form POST, then the run page): the reason once, beside the
        # disabled button, whose tooltip says it too
        r = c.post(f"/runs/{run.id}/resume")
        assert r.status_code == 200 and r.url.path == f"/runs/{run.id}"
        controls = r.text.split('<div id="controls"', 1)[1].split("</h1>", 1)[0]
        assert ALERT not in r.text
        assert controls.count(resume_msg) == 2  # the note and the button's title
        button = _button(r.text, "Resume from step 2")
        assert f'title="Cannot resume: {resume_msg}"' in button and " disabled" in button
        assert f'id="resume-why">Cannot resume: {resume_msg}</p>' in controls
        assert "Continue training from" not in r.text
        # the same through htmx (the controls block)
        r = c.post(f"/runs/{run.id}/resume", headers={"HX-Request": "true"})
        assert r.status_code == 422 and ALERT not in r.text
        assert len(re.findall(re.escape(f">Cannot resume: {resume_msg}<"), r.text)) == 1

        # the Evaluate click: the card comes back with the reason beside checkpoint-2, once
        for headers in ({"HX-Request": "true"}, {}):
            r = c.post(f"/runs/{run.id}/checkpoints/2/evaluate", data={}, headers=headers)
            assert r.status_code == 422, r.text
            assert r.text.count(eval_msg) == 1 and 'id="eval-error"' not in r.text
            assert f'id="evaluate-why-2">{eval_msg}</span>' in r.text

        # a refusal the page does not print beside a button is still shown, above them
        r = c.post(f"/runs/{run.id}/checkpoints/2/evaluate", data={"samples": "0"},
                   headers={"HX-Request": "true"})
        assert r.status_code == 422
        assert 'id="eval-error" role="alert">must be a whole number from 1 to 100</p>' in r.text
