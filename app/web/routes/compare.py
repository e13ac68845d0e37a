"""The compare page: two of the caller's runs side by side (config diff, loss and eval-loss
curves overlaid, evaluation results). The rules are in :mod:`app.studio.compare`; the JSON is
``GET /api/runs/{id}/compare?other=…`` (:mod:`app.web.api.compare`)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from app.studio import compare as compare_uc
from app.studio.errors import StudioError
from app.web.deps import CurrentUser, EngineDep
from app.web.render import render
from app.web.views import compare_view

router = APIRouter()


@router.get("/runs/compare")
def compare_page(request: Request, engine: EngineDep, user: CurrentUser, a: str | None = None,
                 b: str | None = None):
    """Pick two runs (``a``, ``b``); with both, the comparison. Another user's run is a 404."""
    ctx = {"runs": compare_uc.run_choices(engine, user), "a": a or "", "b": b or "",
           "cmp": None, "error": None}
    if a and b:
        try:
            ctx["cmp"] = compare_view(compare_uc.compare_runs(engine, user, a, b))
        except StudioError as exc:
            if exc.kind != "invalid":
                raise
            ctx["error"] = exc.message
    return render(request, "compare.html", ctx, status_code=422 if ctx["error"] else 200)
