"""Dashboard: the caller's runs and newest jobs of every kind with their queue position (an
admin's: everyone's; how many there are in all, the queue page has every running and waiting
one), and the live workers."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse

from app.store import queue, repo
from app.store import workers as workers_store
from app.studio import access
from app.studio import datasets as datasets_uc
from app.studio import jobs as jobs_uc
from app.studio.evaluation import latest_training_metric
from app.studio import runs as runs_uc
from app.studio import worker_view
from app.web.deps import CurrentUser, EngineDep, SettingsDep
from app.web.render import render
from app.web.views import owner_names

router = APIRouter()


def run_rows(engine, user, limit: int = 100) -> list[dict]:
    """The runs ``user`` may see with their state, model/dataset names and latest metric."""
    models = {m.id: m.name for m in repo.list_models(engine)}
    datasets = {d.id: datasets_uc.shown_name(d)  # a deleted one is still named, "(deleted)"
                for d in repo.list_datasets(engine, limit=1000, owner=access.owner_filter(user),
                                            deleted=True)}
    rows = []
    for run in runs_uc.list_runs(engine, user, limit=limit):
        _, job = repo.run_with_job(engine, run.id)
        # the newest training step: a held-out evaluation's metric event has no loss
        metric = latest_training_metric(engine, job.id) if job else None
        rows.append({"id": run.id, "name": run.name, "model_name": models.get(run.model_id, run.model_id),
                     "dataset_name": datasets.get(run.dataset_id, run.dataset_id),
                     "state": job.state if job else "unknown", "created_at": run.created_at,
                     "owner": run.owner, "metric": metric})
    return rows


def _job_runs(engine, user, job_ids) -> dict[int, str]:
    """job id → the run it trains, for the runs ``user`` may see (a worker's current job links
    to its run page only for its owner or an admin)."""
    out = {}
    for job_id in job_ids:
        if job_id is None:
            continue
        try:
            job = queue.get_job(engine, job_id)
        except queue.JobNotFound:
            continue
        if job.run_id and access.can_see(user, job.owner):
            out[job_id] = job.run_id
    return out


@router.get("/runs", include_in_schema=False)
def runs_list():
    """The runs list is the dashboard: ``/runs`` (the natural URL of a list) sends there."""
    return RedirectResponse("/", status_code=303)


@router.get("/")
def dashboard(request: Request, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    workers = workers_store.live(engine, settings.worker_stale_seconds)
    owners = owner_names(engine, user)
    return render(request, "dashboard.html",
                  {"runs": run_rows(engine, user), "workers": workers, "owners": owners,
                   "worker_groups": worker_view.visible_groups(engine, user, workers),
                   "jobs": jobs_uc.list_jobs(engine, user, gpu=worker_view.any_gpu(workers)),
                   "job_counts": jobs_uc.count_jobs(engine, user),
                   "gpu": worker_view.any_gpu(workers),
                   "job_runs": _job_runs(engine, user, [w.current_job_id for w in workers])},
                  block="runs")
