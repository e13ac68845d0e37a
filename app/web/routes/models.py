"""Models: list with status and register from a Hub id, a local folder or a llama2.c checkpoint.
The rules are in :mod:`app.studio.models`."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse

from app.studio import models as models_uc
from app.studio.errors import StudioError
from app.web.deps import CurrentUser, EngineDep, SettingsDep, is_htmx
from app.web.render import render
from app.web.views import owner_names

router = APIRouter()


def _ctx(engine, user, **extra) -> dict:
    return {"models": models_uc.list_models(engine, user), "owners": owner_names(engine, user),
            "form": {}, "errors": {}, **extra}


@router.get("/models")
def models_page(request: Request, engine: EngineDep, user: CurrentUser):
    return render(request, "models.html", _ctx(engine, user), block="model_list")


@router.post("/models")
async def register(request: Request, engine: EngineDep, settings: SettingsDep, user: CurrentUser):
    form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
    form.pop("csrf_token", None)
    try:
        model = models_uc.register_model(engine, settings, user, form)
    except models_uc.ModelFormError as exc:
        return render(request, "models.html",
                      _ctx(engine, user, form=form, errors=exc.fields,
                           form_error="Please fix the fields marked below."),
                      block="register_form", status_code=422)
    if is_htmx(request):
        return render(request, "models.html", _ctx(engine, user, registered=model.name),
                      block="register_form", headers={"HX-Trigger": "model-registered"})
    return RedirectResponse("/models", status_code=303)


def _list_action(request: Request, engine, user, act, done: str):
    """Run ``act()`` (a model use case) for a button of the list; re-render the list with
    ``done`` naming the model, or with the reason of a 409 (conflict)."""
    try:
        model = act()
    except StudioError as exc:
        if exc.kind != "conflict":
            raise
        return render(request, "models.html", _ctx(engine, user, list_error=exc.message),
                      block="model_list", status_code=409)
    if is_htmx(request):
        return render(request, "models.html", _ctx(engine, user, **{done: model.name}),
                      block="model_list")
    return RedirectResponse("/models", status_code=303)


@router.post("/models/{model_id}/delete")
def delete(request: Request, model_id: str, engine: EngineDep, settings: SettingsDep,
           user: CurrentUser):
    """Delete a model (the page asks first); 409 with the reason when runs use it."""
    return _list_action(request, engine, user,
                        lambda: models_uc.delete_model(engine, settings, user, model_id), "deleted")


@router.post("/models/{model_id}/retry")
def retry(request: Request, model_id: str, engine: EngineDep, user: CurrentUser):
    """Queue a failed model's import again; the list shows it pending."""
    return _list_action(request, engine, user,
                        lambda: models_uc.retry_import(engine, user, model_id), "retried")
