"""Dashboard: runs and live workers."""
from __future__ import annotations

from fastapi import APIRouter, Request

from app.store import events, queue, repo
from app.store import workers as workers_store
from app.web.deps import get_engine, get_settings
from app.web.render import render

router = APIRouter()


def run_rows(engine, limit: int = 100) -> list[dict]:
    """Runs with their state, model/dataset names and latest metric, for listings."""
    models = {m.id: m.name for m in repo.list_models(engine)}
    datasets = {d.id: d.filename for d in repo.list_datasets(engine, limit=1000)}
    rows = []
    for run in repo.list_runs(engine, limit=limit):
        _, job = repo.run_with_job(engine, run.id)
        metric = events.latest(engine, job.id, "metric") if job else None
        rows.append({"id": run.id, "name": run.name, "model_name": models.get(run.model_id, run.model_id),
                     "dataset_name": datasets.get(run.dataset_id, run.dataset_id),
                     "state": job.state if job else "unknown", "created_at": run.created_at,
                     "metric": metric.data if metric else None})
    return rows


@router.get("/")
def dashboard(request: Request):
    engine = get_engine(request)
    settings = get_settings(request)
    workers = workers_store.live(engine, settings.worker_stale_seconds)
    return render(request, "dashboard.html",
                  {"runs": run_rows(engine), "workers": workers,
                   "job_runs": _job_runs(engine, [w.current_job_id for w in workers])},
                  block="runs")


def _job_runs(engine, job_ids) -> dict[int, str]:
    """job id → the run it trains (for linking a worker's current job to its run page)."""
    out = {}
    for job_id in job_ids:
        if job_id is None:
            continue
        try:
            job = queue.get_job(engine, job_id)
        except queue.JobNotFound:
            continue
        if job.run_id:
            out[job_id] = job.run_id
    return out
