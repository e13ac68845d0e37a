"""The run page's checkpoint evals: the buttons that queue and cancel one (answer the
Evaluation card, which refreshes itself while an eval is queued or running). The rules are in
:mod:`app.studio.checkpoint_eval`."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse

from app.studio import checkpoint_eval as evals_uc
from app.studio.errors import StudioError
from app.web.deps import CurrentUser, EngineDep, SettingsDep, is_htmx
from app.web.errors import conflict_of
from app.web.render import render
from app.web.views import run_view

router = APIRouter()


@router.post("/runs/{run_id}/checkpoints/{step}/evaluate")
async def evaluate_checkpoint(request: Request, run_id: str, step: int, engine: EngineDep,
                              settings: SettingsDep, user: CurrentUser):
    """Queue the eval of checkpoint ``step``; a refusal (no held-out set, checkpoint gone, an
    eval of it already running) is shown on the card (409/422). Another user's run: 404."""
    form = await request.form()
    error, status = None, 200
    try:
        evals_uc.queue_eval(engine, settings, user, run_id, step, form.get("samples"))
    except StudioError as exc:
        if exc.kind == "not_found" and exc.field is None:
            raise
        error, status = exc.message, 422 if exc.kind == "invalid" else 409
    if not is_htmx(request) and error is None:
        return RedirectResponse(f"/runs/{run_id}#evaluation", status_code=303)
    return render(request, "run.html",
                  run_view(engine, settings, user, run_id, eval_error=error),
                  block="evaluation", status_code=status)


@router.post("/evaluations/{eval_id}/cancel")
def cancel_evaluation(request: Request, eval_id: int, engine: EngineDep, settings: SettingsDep,
                      user: CurrentUser):
    """Stop a checkpoint eval (the card asks first); the Evaluation card again, with the reason
    (409) when it had already ended. Another user's eval: 404."""
    run_id = evals_uc.eval_job(engine, user, eval_id).run_id
    error = conflict_of(evals_uc.cancel_eval, engine, user, eval_id)
    if not is_htmx(request) and error is None:
        return RedirectResponse(f"/runs/{run_id}#evaluation", status_code=303)
    return render(request, "run.html",
                  run_view(engine, settings, user, run_id, eval_error=error),
                  block="evaluation", status_code=409 if error else 200)
