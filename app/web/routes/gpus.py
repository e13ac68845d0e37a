"""The GPU dashboard (``/gpus``, polled by htmx every few seconds) and its JSON twin
(``/api/gpus``): per GPU utilisation, memory, temperature, power, the jobs running there and the
last hour as charts (app/studio/gpu_view.py; the samples come from the supervisors)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from app.studio import gpu_view
from app.web.deps import CurrentUser, EngineDep, SettingsDep
from app.web.render import render

router = APIRouter()


@router.get("/gpus")
def gpus_page(request: Request, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    """The dashboard page; an htmx poll gets only its ``gpus`` block (figures, jobs and the
    chart data that static/gpus.js draws)."""
    data = gpu_view.dashboard(engine, settings, user)
    return render(request, "gpus.html", {"data": data, "series": gpu_view.chart_series(data)},
                  block="gpus")


@router.get("/api/gpus")
def api_gpus(engine: EngineDep, settings: SettingsDep, user: CurrentUser) -> dict:
    """Per GPU: the newest sample's figures (``current``: util_pct %, mem_used_gib and
    mem_total_gib GiB, temp_c °C, power_w W), the jobs running there (another user's job has
    ``visible`` false and no id, run or owner; an admin sees all) and the last hour's samples
    (``history``: parallel lists, ``ts`` in epoch seconds)."""
    return gpu_view.dashboard(engine, settings, user)
