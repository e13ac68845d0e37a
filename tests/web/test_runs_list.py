"""The runs list as a user reads it: the loss of a run that evaluates on a held-out set (its
newest metric event is an evaluation's, without ``loss``)."""
from __future__ import annotations

from app.store import events, queue
from tests.web.test_web_exports import _queued_run


def test_loss_column_shows_the_newest_training_loss_after_an_evaluation(client, engine):
    run_id = _queued_run(client, engine)
    job = queue.claim(engine, "w-test", 30, kinds=["train"])
    events.append_many(engine, job.id, [
        ("metric", {"step": 10, "total_steps": 40, "loss": 3.25}),
        ("metric", {"step": 10, "total_steps": 40, "eval_loss": 3.875})])
    api = client.get(f"/api/runs/{run_id}").json()
    html = client.get("/", headers={"HX-Request": "true", "HX-Target": "runs"}).text
    row = html.split(f'href="/runs/{run_id}"', 1)[1].split("</tr>", 1)[0]
    assert '"Progress">10 / 40</td>' in row and '"Loss">3.25</td>' in row, row
    assert api["metrics"]["last_loss"] == 3.25
