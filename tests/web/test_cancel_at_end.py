"""A cancel that lands after a job's last check but before its end is recorded: a job that
registered how to undo what it wrote (exports, evaluations) ends cancelled with its files gone;
a job without undo steps (training: its adapter is kept) ends succeeded as before. A user's
trial cancelled GGUF exports mid-quantisation and saw them succeed with their files kept."""
from __future__ import annotations

from pathlib import Path

from app.store import queue
from app.store.schema import JobState


def writes_then_returns(ctx) -> dict:
    """Write a file, let a cancel arrive (the user's click after the last ctx.check()), return."""
    out = Path(ctx.settings.data_dir) / f"out-{ctx.job.id}.bin"
    if ctx.payload.get("undo"):
        ctx.on_cancel(lambda: out.unlink(missing_ok=True))
    out.write_bytes(b"x" * 100)
    queue.cancel(ctx.engine, ctx.job.id)
    return {"path": str(out)}


def test_a_cancel_at_the_end_undoes_a_job_that_can_undo(engine, settings, monkeypatch):
    from worker import loop

    monkeypatch.setitem(loop.HANDLERS, "probe", "tests.web.test_cancel_at_end:writes_then_returns")
    w = loop.Worker(settings, worker_id="w-end", kinds=["probe"], poll_interval=0.05)
    w.engine = engine
    ended = {}
    for undo in (True, False):
        queue.enqueue(engine, "probe", {"undo": undo})
        job = queue.claim(engine, w.worker_id, 30, ["probe"])
        ended[undo] = (w.run_job(job), queue.get_job(engine, job.id))
    outcome, job = ended[True]
    assert outcome == "cancelled" and job.state == JobState.CANCELLED and job.result is None
    assert not (Path(settings.data_dir) / f"out-{job.id}.bin").exists()
    outcome, job = ended[False]
    assert outcome == "succeeded" and job.state == JobState.SUCCEEDED
    assert (Path(settings.data_dir) / f"out-{job.id}.bin").exists()
