"""Trial s22 F6: after one click on Evaluate beside checkpoint-40 the row read "checkpoint-40
of run ftjob-… is already being evaluated (evaluation 17, queued); cancel that evaluation to
evaluate it again", as if the click had been refused. The row says what happened; a second
click that is truly refused (another tab) says so above the list, naming the run by its name,
as /api does."""
from __future__ import annotations

from app.store import repo
from tests.web.test_export_checkpoint import _rename
from tests.web.test_gpu_memory_quota_everywhere import alice_and_her_cancelled_run

HTMX = {"HX-Request": "true"}


def test_one_evaluate_click_reads_as_queued_and_a_second_as_refused(app, client, engine,
                                                                   settings) -> None:
    with alice_and_her_cancelled_run(app, client, engine, settings) as (c, _alice, run):
        _rename(engine, run.id, "bob-sft1")
        r = c.post(f"/runs/{run.id}/checkpoints/2/evaluate", data={}, headers=HTMX)
        assert r.status_code == 200, r.text
        [ev] = [j.id for j in repo.list_run_jobs(engine, run.id, "evaluate")]
        row = (f'id="evaluating-2" role="status">Evaluation {ev} queued — results appear below '
               "when it finishes</span>")
        for text in (r.text, c.get(f"/runs/{run.id}").text):
            assert row in text and f'id="checkpoint-eval-{ev}"' in text
            assert "already being evaluated" not in text and 'id="eval-error"' not in text
            assert 'id="evaluate-2"' not in text

        msg = (f"checkpoint-2 of run bob-sft1 is already being evaluated (evaluation {ev}, "
               "queued); cancel that evaluation to evaluate it again")
        r = c.post(f"/runs/{run.id}/checkpoints/2/evaluate", data={}, headers=HTMX)
        assert r.status_code == 409
        assert f'id="eval-error" role="alert">{msg}</p>' in r.text and row in r.text
        assert r.text.count("already being evaluated") == 1
        r = c.post(f"/api/runs/{run.id}/checkpoints/2/evaluations", json={})
        assert r.status_code == 409 and r.json()["error"]["message"] == msg
        [ck] = c.get(f"/api/runs/{run.id}/evaluations").json()["checkpoints"]
        assert ck["can_evaluate"] is False and ck["reason"] == msg
        assert ck["code"] == "being_evaluated" and ck["evaluation"] == {"id": ev,
                                                                          "status": "queued"}
        assert [j.id for j in repo.list_run_jobs(engine, run.id, "evaluate")] == [ev]
