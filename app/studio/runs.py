"""SFT runs: the checks a run must pass before it is queued, creating it, cancelling it.

Every surface (the run form, ``POST /api/runs``, ``POST /v1/fine_tuning/jobs``) calls
:func:`create_sft_run`; GRPO runs reuse the model/dataset/device checks (``app.studio.grpo``).
The chat template is resolved here, once (:func:`app.data.chat_template.choose_template`), and
its name and source are stored in the run's spec: the worker and every export use exactly that.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError
from sqlalchemy.engine import Engine

from app.data.chat_template import choose_template
from app.data.errors import DatasetError
from app.data.model_config import missing_targets
from app.settings import Settings
from app.store import queue, repo
from app.store import workers as workers_store
from app.store.schema import Dataset, Job, JobState, Model, Run
from app.store.specs import TrainSpec, field_bound
from app.studio import access, audit, calibration, datasets, evaluation, untrained, validation
from app.studio.errors import FieldErrors, StudioError, invalid
from app.studio.seqlen import fit_max_seq_length

if TYPE_CHECKING:
    from app.store.schema import User


def field_errors(exc: ValidationError, fields=()) -> tuple[dict[str, str], list[str]]:
    """Map a pydantic ValidationError to ``{field: message}`` plus form-level messages. A
    whole-spec rule's message (a model validator's: no ``loc``) goes under each of ``fields``
    (the spec's field names) it names outside parentheses, e.g. batch × accumulation vs
    num_generations (not "(use num_train_epochs)"); only names with an underscore count, so
    plain words such as "model" are not taken for fields."""
    import re

    out: dict[str, str] = {}
    general: list[str] = []
    for err in exc.errors():
        loc = err.get("loc") or ()
        info = fields.get(loc[0]) if loc and isinstance(fields, dict) else None
        msg = (_in_words(err, info) or err.get("msg", "invalid value")).removeprefix(
            "Value error, ")
        subject = re.sub(r"\([^)]*\)", "", msg)
        named = [w for w in dict.fromkeys(re.findall(r"\b[a-z]+_\w+\b", subject)) if w in fields]
        if loc:
            out.setdefault(str(loc[0]), msg)
        elif named:
            for name in named:
                out.setdefault(name, msg)
        else:
            general.append(msg)
    return out, general


def _num(v: float) -> str:
    """A bound as the messages write it: whole numbers with thousands separators
    (``10,000,000``), others as Python's shortest form (``1e-08``, ``0.5``)."""
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return f"{int(v):,}"
    return f"{v:g}"


def _range_words(info) -> str:
    """The range a pydantic number field allows, in words (the playground's words too):
    " from 1 to 1,024", " greater than 0 and at most 10", " at least 0"; empty without
    bounds."""
    lo = hi = None
    for m in getattr(info, "metadata", None) or ():
        for key, word in (("ge", "at least"), ("gt", "greater than")):
            if getattr(m, key, None) is not None:
                lo = (word, getattr(m, key))
        for key, word in (("le", "at most"), ("lt", "less than")):
            if getattr(m, key, None) is not None:
                hi = (word, getattr(m, key))
    if lo and hi and lo[0] == "at least" and hi[0] == "at most":
        return f" from {_num(lo[1])} to {_num(hi[1])}"
    parts = [f"{b[0]} {_num(b[1])}" for b in (lo, hi) if b]
    return f" {' and '.join(parts)}" if parts else ""


def _in_words(err: dict[str, Any], info) -> str | None:
    """A number field's pydantic error in the studio's words, with the field's range: "must be a
    whole number from 1 to 1,024, written in digits, not '1e6'" (pydantic: "Input should be a
    valid integer, unable to parse string as an integer"); None for every other error."""
    kind, given = err.get("type", ""), err.get("input")
    text = isinstance(given, str)
    tail = f", not {given!r}" if text and len(given) <= 20 else ""
    span = _range_words(info)
    number = "," + span if span.startswith(" at ") else span  # "a whole number, at least 0"
    if kind in ("int_parsing", "int_from_float", "int_type"):
        return f"must be a whole number{number}{', written in digits' if text else ''}{tail}"
    if kind in ("float_parsing", "float_type"):
        return f"must be a number{number}{tail}"
    if kind == "finite_number":
        return f"must be a finite number{number}{tail}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than") and span:
        shown = _num(given) if isinstance(given, (int, float)) and not isinstance(given, bool) \
            else repr(given) if text and len(given) <= 20 else None
        return f"must be{span}" + (f", not {shown}" if shown else "")
    return None


class SpecError(FieldErrors):
    """A spec that fails validation: ``fields`` maps every bad field to its message; the first
    one is the error's ``field`` and ``message`` (kind ``invalid``); ``general``: the
    messages about no one field."""

    FALLBACK = "invalid spec"


def parse_spec(cls: type[BaseModel], raw: dict[str, Any]) -> Any:
    """``cls(**raw)`` (TrainSpec, GrpoSpec, ExportSpec); raises :class:`SpecError` naming the
    fields when it does not validate."""
    try:
        return cls(**raw)
    except ValidationError as exc:
        raise SpecError(*field_errors(exc, cls.model_fields)) from None
    except TypeError as exc:  # a non-string key
        raise SpecError({}, [f"invalid spec: {exc}"]) from None


def check_input(cls: type[BaseModel], raw: dict[str, Any], name: str | None) -> Any:
    """:func:`parse_spec` and :func:`run_name` together, so that a form learns every bad field
    at once (a too-long name and a bad spec value in one answer, not one per submit).

    Raises SpecError listing every bad field, ``name`` included."""
    fields: dict[str, str] = {}
    general: list[str] = []
    spec = None
    try:
        spec = parse_spec(cls, raw)
    except SpecError as exc:
        fields, general = dict(exc.fields), list(exc.general)
    try:
        run_name(name)
    except StudioError as exc:
        fields.setdefault("name", exc.message)
    if fields or general:
        raise SpecError(fields, general)
    return spec


def _for_field(field: str, lookup, *args):
    """``lookup(*args)``, its not-found error re-raised as about the spec's ``field``."""
    try:
        return lookup(*args)
    except StudioError as exc:
        raise StudioError(exc.kind, exc.message, field) from None


#: The largest OpenAI ``learning_rate_multiplier`` (OpenAI's API takes any value above 0 and
#: its own jobs pick about 0.02 to 10); the learning rate it gives passes the form's bounds too.
MAX_LR_MULTIPLIER = 100.0


def learning_rate_from_multiplier(spec_cls: type[BaseModel], value: Any) -> float:
    """The learning rate an OpenAI ``learning_rate_multiplier`` asks for: ``value`` × the
    default ``learning_rate`` of ``spec_cls`` (TrainSpec 2e-4, GrpoSpec 5e-6), checked against
    that field's own bounds, the rule the run forms and ``/api`` apply.

    Raises:
        StudioError: invalid (field ``learning_rate_multiplier``) unless ``value`` is a number
            above 0 and at most :data:`MAX_LR_MULTIPLIER` whose learning rate is within that
            field's bounds (at least ``MIN_LEARNING_RATE``, 1e-8; at most 1).
    """
    field = spec_cls.model_fields["learning_rate"]
    base = field.default
    try:
        m = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        m = float("nan")
    except OverflowError:  # an integer too large for a float (JSON allows 10**400)
        m = float("inf")
    if not 0 < m <= MAX_LR_MULTIPLIER:  # NaN fails too
        shown = repr(value) if m != float("inf") or not isinstance(value, int) else \
            f"a number of {len(str(abs(value)))} digits"
        raise invalid("learning_rate_multiplier", "learning_rate_multiplier must be a number "
                      f"above 0 and at most {MAX_LR_MULTIPLIER:g} (× the default learning rate "
                      f"{base:g}), not {shown}")
    lr = m * base
    bound = field_bound(spec_cls, "learning_rate")
    if bound is not None and lr > bound:
        raise invalid("learning_rate_multiplier", f"learning_rate_multiplier {m:g} × the "
                      f"default learning rate {base:g} = {lr:g} is above the largest "
                      f"learning_rate, {bound:g}")
    low = field_bound(spec_cls, "learning_rate", "ge")
    if low is not None and lr < low:
        raise invalid("learning_rate_multiplier", f"learning_rate_multiplier {m:g} × the "
                      f"default learning rate {base:g} = {lr:g} is below the smallest "
                      f"learning_rate, {low:g}: use at least {low / base:g}")
    return lr


def multiplier_of_learning_rate(spec_cls: type[BaseModel], spec: dict[str, Any]) -> float:
    """The OpenAI ``learning_rate_multiplier`` of a stored ``spec`` of ``spec_cls``: its
    ``learning_rate`` over that class's default, the inverse of
    :func:`learning_rate_from_multiplier` (1.0 when the spec names no learning rate), to 10
    significant digits (so 0.5 reads 0.5, not 0.5000000000000001, and a small one stays)."""
    base = spec_cls.model_fields["learning_rate"].default
    return float(f"{spec.get('learning_rate', base) / base:.10g}")


#: Longest run name (the OpenAI ``suffix`` allows 64; names show in every listing).
MAX_NAME_CHARS = 100


def run_name(name: str | None) -> str | None:
    """A run's display name, trimmed (None when empty).

    Raises StudioError(invalid, ``name``): longer than :data:`MAX_NAME_CHARS` characters, or
    holding control or invisible formatting characters (NUL, bidirectional overrides such as
    U+202E that make a name display as another)."""
    import unicodedata

    if name is None:
        return None
    name = str(name).strip()
    if len(name) > MAX_NAME_CHARS:
        raise invalid("name", f"at most {MAX_NAME_CHARS} characters (this one has {len(name)})")
    bad = sorted({f"U+{ord(c):04X}" for c in name if unicodedata.category(c) in ("Cc", "Cf")})
    if bad:
        raise invalid("name", "control or invisible formatting characters are not allowed "
                              f"({', '.join(bad[:5])})")
    return name or None


def usable_model(engine: Engine, actor: User, spec) -> Model:
    """The spec's model row if the actor may use it. Raises StudioError: not_found (field
    ``model``) when unknown or not the actor's, invalid when it failed to import or is a
    fine-tuned model id (``<base>:ft:<run>``, ``code`` ``fine_tuned_model_not_supported``)."""
    base, ft, _ = str(spec.model).partition(":ft:")
    if ft and not repo.models_named(engine, spec.model):
        raise StudioError("invalid", f"fine-tuning a fine-tuned model ({spec.model!r}) is not "
                          f"supported yet: set model to its base model {base!r} to train a new "
                          "adapter from the base weights (clone the run to reuse its settings, "
                          "or resume it to train it further)", "model",
                          "fine_tuned_model_not_supported")
    model = _for_field("model", access.model, engine, actor, spec.model)
    if model.status == "failed":
        raise invalid("model", f"model {model.name!r} failed to import: "
                               f"{model.error or 'unknown error'}")
    return model


def check_targets(spec, model: Model) -> None:
    """Raises StudioError(invalid, ``target_modules``) when a LoRA target names no module of
    the model."""
    problem = missing_targets(spec.target_modules, model.path, model.name)
    if problem:
        raise invalid("target_modules", problem)


def usable_dataset(engine: Engine, actor: User, spec) -> Dataset:
    """The spec's dataset row if the actor may use it. Raises StudioError: not_found (field
    ``dataset``) when unknown or not the actor's, invalid when it is not processed (still
    validating: "still validating, n/N rows")."""
    ds = validation.check_stale(engine, _for_field("dataset", access.dataset, engine, actor,
                                                   spec.dataset))
    if ds.status == validation.VALIDATING:
        raise invalid("dataset", f"dataset {ds.filename!r} is {validation.progress_text(ds)}; "
                                 "start the run when it is processed")
    if ds.status != "processed":
        raise invalid("dataset", f"dataset {ds.filename!r} is not usable: {ds.error or ds.status}")
    return ds


def sft_dataset_problem(engine: Engine, actor: User, dataset_id: str) -> str | None:
    """Why the SFT run form cannot train on ``dataset_id`` (unknown or another user's, still
    validating, failed validation, a GRPO prompt dataset), for the form that was asked for it;
    None when it can."""
    from types import SimpleNamespace

    try:
        ds = usable_dataset(engine, actor, SimpleNamespace(dataset=dataset_id))
    except StudioError as exc:
        return exc.message
    if ds.format == "prompts":
        return (f"dataset {ds.filename!r} is a GRPO prompt dataset (prompts without responses "
                f"to train on); start a GRPO run on it at /runs/new/grpo?dataset={ds.id}")
    return None


def check_qlora_device(engine: Engine, settings: Settings, spec) -> None:
    """Raises StudioError(invalid, ``load_in_4bit``) when the spec asks for QLoRA and every live
    worker runs without CUDA. With no live worker the run is accepted: a GPU worker may start
    later."""
    if not spec.load_in_4bit:
        return
    live = workers_store.live(engine, settings.worker_stale_seconds)
    if live and not any(workers_store.has_cuda(w) for w in live):
        devices = "; ".join(sorted({w.device for w in live}))
        raise invalid("load_in_4bit", "QLoRA (load_in_4bit) needs a CUDA GPU, and no live "
                      f"worker has one (workers run on: {devices}). Turn load_in_4bit off "
                      "to train LoRA in full precision, or start a worker on a GPU.")


def check_num_gpus(engine: Engine, settings: Settings, spec) -> None:
    """Raises StudioError(invalid, ``num_gpus``) when a data-parallel run asks for more GPUs
    than the live host with the most GPU slots has (a CPU-only box: none, so only 1), or
    (``gradient_accumulation_steps``) when the accumulation steps do not split evenly over the
    GPUs: each GPU runs ``gradient_accumulation_steps / num_gpus`` micro-batches of a step, so
    the effective batch stays the 1-GPU run's."""
    n = getattr(spec, "num_gpus", 1)
    if n <= 1:
        return
    most = workers_store.most_gpus_on_one_host(engine, settings.worker_stale_seconds)
    if n > most:
        have = (f"the live host with the most GPUs has {most}" if most else
                "no live worker has a GPU (a CPU-only box trains on one process)")
        raise invalid("num_gpus", f"num_gpus {n} is more than this box has: {have}. "
                      f"Set num_gpus to at most {max(most, 1)}.")
    if spec.gradient_accumulation_steps % n:
        raise invalid("gradient_accumulation_steps",
                      f"gradient_accumulation_steps ({spec.gradient_accumulation_steps}) must be "
                      f"a multiple of num_gpus ({n}): each GPU runs gradient_accumulation_steps "
                      "/ num_gpus micro-batches of every step, so the effective batch stays "
                      "that of a 1-GPU run")


def resolved_template(spec, model: Model):
    """``spec`` with ``chat_template`` set to the resolved source and ``chat_template_name`` to
    its name (see :func:`app.data.chat_template.choose_template`).

    Blocking: a custom or model template is checked in a child process (up to
    :data:`app.data.template_check.TIME_BUDGET_S` seconds).

    Raises StudioError(invalid, ``chat_template``) when the template does not compile, cannot
    render a sample chat, or runs over the time or memory budget."""
    try:
        name, source = choose_template(spec.chat_template, model.chat_template)
    except DatasetError as exc:
        raise invalid("chat_template", str(exc)) from None
    return spec.model_copy(update={"chat_template": source, "chat_template_name": name})


def template_tokens_to_add(model: Model | None, template: str | None) -> list[str] | None:
    """The special markers of ``template`` (a built-in default's source: trusted, rendered here)
    that ``model``'s tokenizer files lack: what ``add_template_tokens`` would add. Reads the
    tokenizer with ``tokenizers`` (no torch; cached). None when not knowable (no model, no
    template, unreadable tokenizer)."""
    from app.data.template_tokens import missing_for_model

    if model is None or not template or not model.path:
        return None
    return missing_for_model(model.path, template)


def create_sft_run(engine: Engine, settings: Settings, actor: User, spec: TrainSpec,
                   name: str | None = None) -> tuple[Run, Job]:
    """Check the model and dataset are usable by ``actor``, resolve the chat template, then
    create the run (owned by the actor) and queue its job.

    Raises:
        StudioError: not_found for an unknown (or another user's) model or dataset; invalid for
            a failed model, LoRA targets the model does not have, an unusable or GRPO-prompt
            dataset, a dataset whose report finds no trained token with the run's settings
            (:func:`app.studio.untrained.check_trainable`), a chat template that does not parse or render a sample conversation, a
            max_seq_length past the model's context or too short for its template,
            held-out evaluation settings that cannot work (:mod:`app.studio.evaluation`),
            QLoRA when every live worker runs without CUDA, more GPUs than a live host has
            (:func:`check_num_gpus`), a run whose estimated GPU memory (per GPU) exceeds the
            largest live GPU (code ``too_big_for_gpus``).
    """
    name = run_name(name)
    model = usable_model(engine, actor, spec)
    spec = fit_max_seq_length(resolved_template(spec, model), model)
    check_targets(spec, model)
    ds = usable_dataset(engine, actor, spec)
    evaluation.check_held_out(engine, actor, spec, ds.rows)
    if ds.format == "prompts":
        why = (ds.report or {}).get("sft_error")
        raise invalid("dataset", f"dataset {ds.filename!r} is a GRPO prompt dataset (prompts "
                                 f"without responses to train on), not an SFT dataset"
                                 + (f" ({why})" if why else "") + "; start a GRPO run on it "
                                 f"at /runs/new/grpo?dataset={ds.id}")
    mapping = (ds.report or {}).get("column_mapping")
    if mapping and not spec.column_mapping:  # preview == training: the dataset's own mapping
        spec = spec.model_copy(update={"column_mapping": mapping})
    untrained.check_trainable(ds, model, spec)
    check_qlora_device(engine, settings, spec)
    check_num_gpus(engine, settings, spec)
    estimate_gib = calibration.for_new_run(engine, settings, model, spec, "sft", actor)
    run, job = repo.create_run(engine, spec, name=name, owner=actor.id, estimate_gib=estimate_gib)
    audit.record(engine, actor.id, "run.created", "run", run.id, kind="sft", model=model.name,
                 dataset=ds.id)
    return run, job


def list_runs(engine: Engine, actor: User, limit: int = 100, after: str | None = None) -> list[Run]:
    """The runs ``actor`` may see, newest first (``after``: a run id, OpenAI-style cursor).
    Raises StudioError not_found (field ``after``) when ``after`` is not a run ``actor`` may
    see: a silent first page would repeat the runs a client already has."""
    if after:
        try:
            access.run(engine, actor, after)
        except StudioError:
            raise StudioError("not_found", f"after: no fine-tuning job with id {after!r} to list "
                              "after", "after", "fine_tuning_job_not_found") from None
    return repo.list_runs(engine, limit=limit, after=after, owner=access.owner_filter(actor))


def cancel_run(engine: Engine, actor: User, run_id: str, *, if_running: bool = False) -> Run:
    """Ask the run's job to stop (the worker stops it at the next step).

    Raises:
        StudioError: not_found (unknown or another user's run); conflict when ``if_running``
            and the job already ended (else an ended run is returned unchanged, unaudited).
    """
    run, job = access.run_with_job(engine, actor, run_id)
    if job is not None:
        if job.state in JobState.FINAL:  # nothing to cancel, nothing to record
            if if_running:
                raise StudioError("conflict", f"fine-tuning job {run_id} is already {job.state}")
            return run
        queue.cancel(engine, job.id)
        audit.record(engine, actor.id, "run.cancelled", "run", run.id)
    return run


def input_names(engine: Engine, run: Run) -> tuple[str, str]:
    """(the run's model name, its dataset's file name), each the id when its row is gone; a
    deleted dataset's name ends with " (deleted)"."""
    try:
        model_name = repo.get_model(engine, run.model_id).name
    except repo.NotFound:
        model_name = run.model_id
    try:
        dataset_name = datasets.shown_name(repo.get_dataset(engine, run.dataset_id, deleted=True))
    except repo.NotFound:
        dataset_name = run.dataset_id
    return model_name, dataset_name
