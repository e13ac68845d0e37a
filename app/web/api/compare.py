"""``GET /api/runs/{run_id}/compare?other=…``: two runs side by side (:mod:`app.studio.compare`)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.studio import access
from app.studio import compare as compare_uc
from app.studio.errors import invalid
from app.web.deps import CurrentUser, EngineDep

router = APIRouter(prefix="/api", tags=["runs"])


@router.get("/runs/{run_id}/compare")
def compare_runs(run_id: str, engine: EngineDep, user: CurrentUser,
                 other: str | None = None) -> dict[str, Any]:
    """``{"a", "b", "diff"}`` for this run (a) and ``other`` (b): each run's id, name, kind,
    model, dataset, state, curves (``loss``, ``eval_loss``, GRPO's ``reward``, ``kl`` and
    ``rewards`` per function, as ``[step, value]`` pairs), result and evaluation; ``diff`` the
    spec fields that differ (``field``, ``a``, ``b``; ``a_label``/``b_label`` naming ids and
    rewards in words) (:func:`app.studio.compare.compare_runs`)."""
    access.run(engine, user, run_id)
    if not other:
        raise invalid("other", "name the run to compare with (?other=<run id>)")
    return compare_uc.compare_runs(engine, user, run_id, other)
