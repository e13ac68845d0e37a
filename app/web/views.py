"""View models that several pages share (the run page embeds the exports card; the run forms
share the chat-template panel). Plain dicts for the templates; every object read goes through
the use-case layer's ownership checks."""
from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import RedirectResponse, Response

from app.data.chat_template import DEFAULT_TEMPLATES, FALLBACK_TEMPLATE
from app.store import repo
from app.store.schema import JobState
from app.studio import (access, accounts, calibration, checkpoint_eval, checkpoint_files,
                        evaluation, playground_targets, resume, train_time, untrained)
from app.studio import exports as exports_uc
from app.studio.compare import RESULT_LABELS
from app.studio import verification
from app.studio.errors import StudioError, said_once
from app.studio.estimate import memory_words
from app.studio.job_states import never_started, no_checkpoint_words, state_words
from app.studio.runs import input_names, template_tokens_to_add
from app.web.deps import is_htmx

# What the run page lists under "Artifacts"; export files are listed under "Exports".
RUN_ARTIFACT_KINDS = ("adapter", "config", "metrics", "eval")


def template_ctx(engine, user, model_ref: str | None, choice: str | None = None,
                 text: str | None = None) -> dict[str, Any]:
    """What the chat-template part of a run form shows for the chosen model."""
    model = None
    if model_ref:
        try:
            model = access.model(engine, user, model_ref)
        except StudioError:
            model = None
    names = list(DEFAULT_TEMPLATES)
    chosen = choice if choice in DEFAULT_TEMPLATES else FALLBACK_TEMPLATE
    return {"model_name": model.name if model else None,
            "model_has_template": bool(model and model.chat_template),
            "names": names, "choice": chosen,
            "text": text if text else DEFAULT_TEMPLATES[chosen],
            # what add_template_tokens would add (a built-in template only: no user Jinja here)
            "missing_tokens": None if model is None or model.chat_template else
            template_tokens_to_add(model, DEFAULT_TEMPLATES[chosen])}


def exports_view(engine, user, run_id: str, error: str | None = None,
                 values: dict[str, Any] | None = None,
                 field_errors: dict[str, str] | None = None) -> dict[str, Any]:
    """The exports card of a run page: the form's choices and values, and the run's exports;
    ``error`` shows under the form, ``field_errors`` (``{field: message}``) beside each field;
    ``export_from`` says which checkpoint a cancelled or failed run exports, and
    ``export_unavailable`` why the run cannot be exported (None when it can)."""
    run, job = access.run_with_job(engine, user, run_id)
    items = [{**e, "verification_summary": verification.summarize(e["verification"])}
             for e in exports_uc.list_exports(engine, user, run_id)]
    can_export, checkpoint = exports_uc.exportable(engine, run.id, job)
    if can_export:
        unavailable = None
    elif job is not None and job.state in (JobState.CANCELLED, JobState.FAILED):
        unavailable = f"The run {no_checkpoint_words(run, job)}, so there is nothing to export."
    else:
        unavailable = ("Exports become available when training has succeeded, or from the "
                       "newest checkpoint of a cancelled run.")
    return {"run": run, "exports": items, "export_formats": exports_uc.FORMATS,
            "export_quants": exports_uc.QUANTS, "export_quant_notes": exports_uc.QUANT_NOTES,
            "export_error": error, "export_field_errors": field_errors or {},
            "export_values": values or {"format": "gguf", "quantization": ["Q8_0"]},
            "can_export": can_export,
            "export_from": (f"The run {state_words(job.state)}: exports are made from its "
                            f"newest checkpoint, step {checkpoint}.") if checkpoint else None,
            "export_unavailable": unavailable,
            "exports_active": any(e["status"] in (JobState.QUEUED, JobState.RUNNING) for e in items)}


def _state(job) -> str:
    """The run page's State badge: its job's state, ``"unknown"`` without a job."""
    return job.state if job else "unknown"


def place_view(engine, user, run_id: str) -> dict[str, Any]:
    """What the run page's ``place`` block needs when it is polled (every 5 s while the job is
    queued): the run and its job's ``state``, and ``place_poll`` (the fragment then carries the
    State badge out of band); not :func:`run_view`'s checkpoint folders and event scans."""
    run, job = access.run_with_job(engine, user, run_id)
    return {"run": run, "job": job, "state": _state(job), "place_poll": True}


def run_view(engine, settings, user, run_id: str, controls_error: str | None = None,
             eval_error: str | None = None) -> dict[str, Any]:
    """Everything the run page shows at load time (what ``user`` can start: resume, evaluate a
    checkpoint, under ``settings``' admission rules and the owner's GPU memory quota).
    ``controls_error`` / ``eval_error``: the refusal of a click just made (Resume, Delete;
    Evaluate), shown above the controls / on the Evaluation card unless the page already
    says it beside the disabled button (:func:`app.studio.errors.said_once`)."""
    run, job = access.run_with_job(engine, user, run_id)
    # the tiles show the newest training step (an evaluation's metric event has no loss)
    m = evaluation.latest_training_metric(engine, job.id) if job else None
    progress = 0
    if m and m.get("total_steps"):
        progress = min(100, round(100 * m["step"] / max(1, m["total_steps"])))
    state = _state(job)
    if state == JobState.SUCCEEDED:
        progress = 100
    model_name, dataset_name = input_names(engine, run)
    spec = run.spec or {}
    card = evaluation.run_evaluation(engine, run, job, settings, user)
    resume_now = resume.resume_state(engine, settings, user, run, job)
    why = resume.why_not(resume_now, job)
    return {"run": run, "job": job, "state": state, "metric": m, "progress": progress,
            "error": job.error if job else None,
            "cancel_requested": bool(job and job.cancel_requested),
            "never_started": never_started(job),
            "artifacts": [a for a in repo.list_artifacts(engine, run.id)
                          if a.kind in RUN_ARTIFACT_KINDS and not (a.meta or {}).get("export_id")],
            "checkpoints": checkpoint_files.listing(engine, run.id),
            "training_time": train_time.training_time(engine, job),
            "model_name": model_name, "dataset_name": dataset_name,
            "template_name": spec.get("chat_template_name"),
            "template_source": spec.get("chat_template"),
            "spec_json": json.dumps(spec, indent=2), "memory": calibration.memory_summary(job),
            "metric_peak": calibration.metric_peak(job, m),
            "evaluation": card, "resume": resume_now, "resume_why": why,
            "controls_error": said_once(controls_error, [why]),
            "eval_error": said_once(eval_error, checkpoint_eval.shown_reasons(card)),
            "playground_link": playground_targets.run_link(engine, run, job),
            "cancel_outcome": resume.cancel_outcome(engine, run, job, (m or {}).get("step")),
            **exports_view(engine, user, run.id)}


def form_fields(template: str) -> set[str]:
    """The field names a form template shows: its ``name="..."`` inputs and the fields it
    renders through the ``field``/``opt_number`` macros."""
    import re

    from app.web.render import env

    src = env.loader.get_source(env, template)[0]
    return set(re.findall(r'name="(\w+)"', src)) | set(
        re.findall(r"(?:field|opt_number)\('(\w+)'", src))


def form_notices(user, general: list | None) -> list:
    """A run form's notices above it: ``general`` (a refusal of the submitted spec), and, before
    Start, why no run of ``user`` can start at all (their Jobs at once is 0:
    :func:`app.studio.calibration.held_refusal`), once."""
    out = list(general or [])
    held = calibration.held_refusal(user) if user is not None else None
    if held is not None and held.message not in out:
        out.append(held.message)
    return out


def kept_fields(values: dict[str, Any], spec_cls, template: str) -> dict[str, Any]:
    """Spec fields of a run form's ``values`` that ``template`` does not show and that differ
    from their default (a clone's ``weight_decay``, ``optim``, ...): the form carries them as
    hidden inputs, so that a cloned run keeps every setting of the run it copies."""
    shown = form_fields(template)
    out = {}
    for k, f in spec_cls.model_fields.items():
        v = values.get(k)
        if k in shown or v is None or isinstance(v, (list, dict)):
            continue
        if v != f.get_default(call_default_factory=True):
            out[k] = v
    return out


def clone_values(clone, defaults: dict[str, Any]) -> dict[str, Any]:
    """A run form's values from :class:`app.studio.clone.Clone`: its spec over the form's
    ``defaults`` (every spec field; the form shows some, the rest go as hidden inputs)."""
    return {**defaults, **clone.spec, "name": clone.name, "clone_deleted": clone.deleted}


def dataset_label(ds, owners: dict[str, str] | None = None, me: str | None = None) -> str:
    """A dataset as a picker lists it, so that two files of one name can be told apart:
    ``train.jsonl — GRPO prompts, 7,473 rows, 2026-12-01 14:03 · …9a3f1c``; another user's
    (an admin's pickers, ``owners`` from :func:`owner_names`, ``me`` the admin's id) ends with
    `` · bob's``; an SFT dataset whose report finds no trained token ends with that
    (:func:`app.studio.untrained.report_note`)."""
    import datetime as dt

    kind = "GRPO prompts" if ds.format == "prompts" else f"SFT {ds.format or '?'}"
    rows = f"{ds.rows:,} rows" if isinstance(ds.rows, int) else "? rows"
    when = dt.datetime.fromtimestamp(ds.created_at).strftime("%Y-%m-%d %H:%M")
    whose = f" · {owners.get(ds.owner, 'another user')}'s" if owners and ds.owner != me else ""
    note = untrained.report_note(ds)
    return f"{ds.filename} — {kind}, {rows}, {when} · …{ds.id[-6:]}{whose}" + \
        (f" · {note}" if note else "")


def dataset_labeller(engine, user):
    """:func:`dataset_label` for ``user``'s pickers (owners named on an admin's)."""
    owners = owner_names(engine, user)
    return lambda ds: dataset_label(ds, owners, user.id)


def grpo_datasets(datasets: list, selected: str | None) -> list:
    """The GRPO form's dataset choices: prompt datasets (newest first) and, after them, only
    the other dataset the form already names (a link from an SFT dataset's page)."""
    prompts = [d for d in datasets if d.format == "prompts"]
    return prompts + [d for d in datasets if d.format != "prompts" and d.id == selected]


def owner_names(engine, user) -> dict[str, str]:
    """user id -> name, for the Owner columns an admin sees (empty for a member, who sees only
    their own objects)."""
    if not access.is_admin(user):
        return {}
    return {u.id: u.name for u in accounts.list_users(engine, user)}


async def create_from_form(spec_cls, raw: dict, errors: dict[str, str], create,
                           field_of=lambda field: field, name: str | None = None
                           ) -> tuple[Any, dict[str, str], list[str]]:
    """Validate a run form's ``raw`` input as ``spec_cls`` and its run ``name`` and, when
    ``errors`` (the form's own checks) is empty, ``create(spec)`` off the event loop: ``(run or
    None, field errors, form-level messages)``. A spec error lists every bad field (the name's
    too); a use-case error about one field goes under ``field_of(field)``; one about the whole
    spec (too big for every GPU, over the GPU memory quota) above the form; any other is raised
    (the surface's error mapping answers it)."""
    from starlette.concurrency import run_in_threadpool

    from app.studio.runs import SpecError, check_input

    run, general = None, []
    try:
        spec = check_input(spec_cls, raw, name)
        if not errors:
            run, _ = await run_in_threadpool(create, spec)
    except SpecError as exc:
        errors, general = {**exc.fields, **errors}, exc.general
    except StudioError as exc:
        if exc.code in calibration.WHOLE_SPEC_CODES:  # about the whole spec: above the form
            general.append(exc.message)
        elif exc.field is None:
            raise
        else:
            errors[field_of(exc.field)] = exc.message
    return run, errors, general


def redirect_to_run(request: Request, run) -> Response:
    """After a form created a run: go to its page (HX-Redirect for htmx, else 303)."""
    url = f"/runs/{run.id}"
    if is_htmx(request):
        return Response(status_code=200, headers={"HX-Redirect": url})
    return RedirectResponse(url, status_code=303)


#: Form fields the memory estimate reads (the fragment re-renders when one of them changes).
ESTIMATE_FIELDS = ("model", "r", "target_modules", "load_in_4bit", "optim", "max_seq_length",
                   "per_device_train_batch_size", "gradient_accumulation_steps",
                   "vram_budget_gib", "num_generations", "max_prompt_length",
                   "max_completion_length")


def estimate_view(engine, settings, user, run_kind: str, params) -> dict[str, Any]:
    """The run form's memory estimate (``sft`` or ``grpo``) from the form's current values
    (``params``: a multi-dict, e.g. the query string): ``estimate`` (``Estimate.as_dict()``) or
    ``estimate_problem`` (what to fill in first), ``estimate_words`` (how every page says it:
    :func:`app.studio.estimate.memory_words`), the largest live GPU (GiB) and whether it fits."""
    from app.store import workers as workers_store
    from app.store.specs import GrpoSpec, TrainSpec
    from app.studio.runs import SpecError, parse_spec

    cls = GrpoSpec if run_kind == "grpo" else TrainSpec
    raw: dict[str, Any] = {k: params.get(k) for k in ESTIMATE_FIELDS
                           if k in cls.model_fields and str(params.get(k) or "").strip()}
    raw["target_modules"] = list(params.getlist("target_modules")) or [""]
    raw["load_in_4bit"] = params.get("load_in_4bit") in ("true", "on", "1")
    raw.update(model=raw.get("model") or "", dataset="-")
    if run_kind == "grpo":  # the estimate does not depend on the rewards; a valid group size does
        raw["rewards"] = [{"name": "format"}]
    out: dict[str, Any] = {"estimate": None, "estimate_problem": None, "largest_gpu_gib":
                           workers_store.largest_gpu_gib(engine, settings.worker_stale_seconds),
                           "gpus_on_host": workers_store.most_gpus_on_one_host(
                               engine, settings.worker_stale_seconds)}
    try:
        model = access.model(engine, user, raw["model"])
        spec = parse_spec(cls, raw)
    except SpecError as exc:
        out["estimate_problem"] = "; ".join(f"{k}: {v}" for k, v in exc.fields.items()) \
            or "; ".join(exc.general)
        return out
    except StudioError:
        out["estimate_problem"] = "choose a model"
        return out
    est = calibration.estimate(engine, model, spec, calibration.job_kind(run_kind))
    if est is None:
        out["estimate_problem"] = f"{model.name} is not imported yet; its shape is unknown"
        return out
    out["estimate"] = est.as_dict()
    out["estimate_words"] = memory_words(est.allocated_gib, calibration.job_kind(run_kind))
    largest = out["largest_gpu_gib"]
    out["estimate_fits"] = largest is None or est.total_gib <= largest
    return out


async def estimate_fragment(request: Request, engine, settings, user, run_kind: str):
    """The ``_memory_estimate.html`` fragment for a run form (``sft`` or ``grpo``) from the
    submitted form's current values (see :func:`estimate_view`)."""
    from starlette.concurrency import run_in_threadpool

    from app.web.render import render

    url = "/runs/new/grpo/estimate" if run_kind == "grpo" else "/runs/new/estimate"
    ctx = await run_in_threadpool(estimate_view, engine, settings, user, run_kind,
                                  await request.form())
    return render(request, "_memory_estimate.html",
                  {**ctx, "estimate_url": url, "estimate_refreshed": True}, block="memory_estimate")


def spec_value_text(value: Any) -> str:
    """A spec value as the compare page's diff shows it, one way for every field: not set
    ``"—"``, a string as it is, anything else as JSON (``null``, ``true``, ``0.0002``,
    ``[{"name": "format", "weight": null}]``), never a Python repr."""
    if value is None:
        return "—"
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=False)


def compare_view(cmp: dict[str, Any]) -> dict[str, Any]:
    """:func:`app.studio.compare.compare_runs`'s answer with each diff row's ``a_text`` and
    ``b_text`` (its ``a_label``/``b_label`` where the use case named the value, else
    :func:`spec_value_text`) and each side's ``result_rows``
    (``[(key, label, value)]``, labelled by :data:`app.studio.compare.RESULT_LABELS`) for the
    page."""
    diff = [{**d, "a_text": d.get("a_label") or spec_value_text(d["a"]),
             "b_text": d.get("b_label") or spec_value_text(d["b"])} for d in cmp["diff"]]
    sides = {key: {**cmp[key], "result_rows": [(k, RESULT_LABELS[k], v)
                                               for k, v in cmp[key]["result"].items()]}
             for key in ("a", "b")}
    kinds = {cmp[k]["kind"] for k in ("a", "b")}
    return {**cmp, **sides, "diff": diff, "any_sft": kinds != {"grpo"},
            "any_grpo": "grpo" in kinds}
