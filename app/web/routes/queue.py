"""The queue page (``/queue``, polled by htmx) and its JSON twin (``/api/queue``): per GPU the
running jobs with memory and ETA, the waiting jobs in admission order with why each waits and an
estimated start; an admin's "move to the front". The Admin page's quota section (a fragment it
loads from ``/admin/quotas``: quotas and fair-share weights per user, GPU-hours per user and per
run) and the GPU-hours CSV (``/admin/usage.csv``) live here too."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse, Response

from app.studio import accounts, queue_view, quotas
from app.studio.errors import StudioError, field_messages
from app.web.deps import CurrentUser, EngineDep, SettingsDep, is_htmx
from app.web.render import render

router = APIRouter()


@router.get("/queue")
def queue_page(request: Request, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    view = queue_view.queue_view(engine, settings, user)
    return render(request, "queue.html", {"view": view}, block="queue")


@router.get("/api/queue")
def api_queue(engine: EngineDep, settings: SettingsDep, user: CurrentUser) -> dict:
    """GPUs with their running jobs and the waiting jobs in admission order (GiB, seconds), and
    ``cpu``: the CPU lane's ``lanes``, ``running`` and ``waiting`` jobs in claim order; another
    user's job has ``visible`` false and no id, run or owner (an admin sees all)."""
    return queue_view.as_json(queue_view.queue_view(engine, settings, user))


@router.post("/queue/jobs/{job_id}/front")
def queue_move_to_front(engine: EngineDep, user: CurrentUser, job_id: int):
    """Admin only: put a waiting job first in admission order."""
    quotas.move_to_front(engine, user, job_id)
    return RedirectResponse("/queue", status_code=303)


@router.post("/api/queue/jobs/{job_id}/front")
def api_move_to_front(engine: EngineDep, user: CurrentUser, job_id: int) -> dict:
    """Admin only: put a waiting job first in admission order."""
    job = quotas.move_to_front(engine, user, job_id)
    return {"id": job.id, "state": job.state, "front_at": job.front_at}


def _quotas(request: Request, engine, user, status: int = 200, **extra) -> Response:
    users = accounts.list_users(engine, user)
    rows, per_user = quotas.usage(engine, user)
    note = quotas.gpu_hours_note(engine, request.app.state.settings.worker_stale_seconds)
    return render(request, "_admin_quotas.html", {"users": users, "usage_rows": rows[:50],
                                                  "usage_per_user": per_user, "gpu_hours_note": note,
                                                  "labels": quotas.LABELS, **extra},
                  status_code=status)


@router.get("/admin/quotas")
def admin_quotas(request: Request, engine: EngineDep, user: CurrentUser):
    """Admin only: the quota section of the Admin page (a fragment)."""
    return _quotas(request, engine, user)


@router.post("/admin/quotas/{user_id}")
def admin_quota_set(request: Request, engine: EngineDep, user: CurrentUser, user_id: str,
                    quota_jobs: Annotated[str, Form()] = "", quota_gib: Annotated[str, Form()] = "",
                    quota_gpu_hours: Annotated[str, Form()] = "",
                    share_weight: Annotated[str, Form()] = "1"):
    """Admin only: one user's quotas (empty = no limit) and fair-share weight."""
    try:
        target = quotas.set_quota(engine, user, user_id, jobs=quota_jobs, gib=quota_gib,
                                  gpu_hours=quota_gpu_hours, weight=share_weight)
    except StudioError as exc:
        if exc.kind != "invalid":
            raise
        submitted = {"quota_jobs": quota_jobs, "quota_gib": quota_gib,
                     "quota_gpu_hours": quota_gpu_hours, "share_weight": share_weight}
        return _quotas(request, engine, user, 422, quota_error=exc.message, error_user=user_id,
                       submitted=submitted,
                       field_errors=field_messages(exc, None))
    if not is_htmx(request):
        return RedirectResponse("/admin#quotas", status_code=303)
    return _quotas(request, engine, user, quota_notice=f"Saved the quotas of {target.name}.")


@router.get("/admin/usage.csv")
def admin_usage_csv(engine: EngineDep, user: CurrentUser, days: float = 30.0):
    """Admin only: GPU-hours per job (run) of the last ``days`` days as CSV."""
    body = quotas.usage_csv(engine, user, min(max(days, 0.0), 3660.0))
    return Response(body, media_type="text/csv; charset=utf-8",
                    headers={"Content-Disposition": 'attachment; filename="gpu-usage.csv"'})
