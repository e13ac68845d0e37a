"""A run's GPU memory estimate, corrected by the peaks measured on earlier jobs; the refusal of
a run no GPU could hold (:func:`check_fits`) and of a GPU job its owner's memory quota could
never admit (:func:`check_job_quota`); a job's estimate beside its measured peak for the run
page and ``/api`` (:func:`memory_summary`, :func:`metric_peak`).

The correction is per (model, job kind, 4-bit or not): the median of ``measured / estimated``
over the newest :data:`WINDOW` succeeded jobs of that key whose worker measured a GPU peak
(``jobs.peak_kind = 'gpu'``; a CPU worker's RSS says nothing about a GPU). The estimate of each
earlier job is recomputed from its run's stored spec with today's formula, so a change of the
formula never mixes with old stored figures. One calibration run is enough; the median keeps one
odd run from swinging it; the factor is clamped to [:data:`MIN_FACTOR`, :data:`MAX_FACTOR`].
"""
from __future__ import annotations

from statistics import median
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine
from sqlmodel import select

from app.settings import Settings
from app.store import admission
from app.store import workers as workers_store
from app.store.db import session_scope
from app.store.schema import Job, JobState, Model, Run, User
from app.store.specs import GrpoSpec, TrainSpec
from app.studio.errors import StudioError
from app.studio.estimate import (CUDA_CONTEXT_GIB, Estimate, estimate_job, memory_words,
                                 model_shape)

if TYPE_CHECKING:
    from pydantic import BaseModel

WINDOW = 20
MIN_FACTOR, MAX_FACTOR = 0.5, 4.0
_SPECS: dict[str, type[BaseModel]] = {"train": TrainSpec, "grpo": GrpoSpec}


def job_kind(run_kind: str) -> str:
    """The job kind of a run kind (``sft`` -> ``train``, ``grpo`` -> ``grpo``)."""
    return "train" if run_kind == "sft" else run_kind


def raw_estimate(model: Model, spec: Any, kind: str) -> Estimate | None:
    """The uncorrected estimate of a ``kind`` job (``train`` | ``grpo`` | ``export`` |
    ``import_model``) of ``model``; None when the model's shape is unknown."""
    return estimate_job(kind, model_shape(model.info, model.path), spec)


def measured_pairs(engine: Engine, model: Model, kind: str, four_bit: bool,
                   window: int = WINDOW) -> list[tuple[float, float]]:
    """``(estimated, measured)`` allocator peaks in GiB of the newest succeeded ``kind`` jobs of
    ``model`` with the same ``load_in_4bit`` whose GPU peak was measured, newest first."""
    with session_scope(engine) as s:
        rows = s.exec(
            select(Job.peak_gib, Run.spec).join(Run, Run.id == Job.run_id)
            .where(Run.model_id == model.id, Job.kind == kind, Job.state == JobState.SUCCEEDED,
                   Job.peak_kind == "gpu", Job.peak_gib.is_not(None))
            .order_by(Job.id.desc()).limit(4 * window)).all()
    out: list[tuple[float, float]] = []
    for peak, raw_spec in rows:
        if bool(raw_spec.get("load_in_4bit")) != four_bit:
            continue
        try:
            spec = _SPECS[kind](**raw_spec)
        except Exception:  # noqa: BLE001 - a spec an older version stored: skip it
            continue
        est = raw_estimate(model, spec, kind)
        if est is not None and est.allocated_gib > 0 and peak > 0:
            out.append((est.allocated_gib, float(peak)))
        if len(out) >= window:
            break
    return out


def correction(engine: Engine, model: Model, kind: str, four_bit: bool) -> tuple[float, int]:
    """``(factor, n)``: the median measured/estimated ratio over ``n`` earlier jobs (1.0, 0 when
    none), clamped to [MIN_FACTOR, MAX_FACTOR]."""
    pairs = measured_pairs(engine, model, kind, four_bit)
    if not pairs:
        return 1.0, 0
    factor = median(m / e for e, m in pairs)
    return min(MAX_FACTOR, max(MIN_FACTOR, factor)), len(pairs)


def estimate(engine: Engine, model: Model, spec: Any, kind: str) -> Estimate | None:
    """The estimate of a ``kind`` job for ``spec`` on ``model``, corrected by earlier measured
    peaks (see the module docstring); None when the model's shape is unknown."""
    est = raw_estimate(model, spec, kind)
    if est is None or kind not in _SPECS:
        return est
    factor, n = correction(engine, model, kind, bool(spec.load_in_4bit))
    return est.corrected(factor, n)


def check_fits(engine: Engine, settings: Settings, est: Estimate | None) -> None:
    """Refuse a job no live GPU could ever admit: raises StudioError(invalid, code
    ``too_big_for_gpus``) naming the estimate and the largest GPU (GiB) when the memory the job
    would be admitted with (:func:`app.store.admission.need_gib`: the estimate plus
    ``settings.gpu_admit_margin`` and the CUDA context) exceeds that GPU's capacity (its total
    less ``settings.gpu_reserve_gib``). No estimate, or no live worker reporting a GPU (CPU
    workers only, or none yet): no refusal."""
    if est is None or est.total_gib <= 0:
        return
    best = workers_store.largest_capacity_gib(engine, settings.worker_stale_seconds,
                                              settings.gpu_reserve_gib)
    need = admission.need_gib(est.allocated_gib, settings.gpu_admit_margin, None)
    if best is not None and (need > best[1] or est.total_gib > best[0]):
        largest, capacity = best
        raise StudioError(
            "invalid", f"this run needs about {est.total_gib:.1f} GiB of GPU memory (estimate: "
            f"weights {est.weights_gib:.1f}, adapter + optimizer {est.adapter_optimizer_gib:.1f}, "
            f"activations {est.activations_gib:.1f}, logits {est.logits_gib:.1f}, KV cache "
            f"{est.kv_cache_gib:.1f}, CUDA context {est.context_gib:.1f}), {need:.1f} GiB with "
            f"the {settings.gpu_admit_margin:.0%} admission margin; the largest GPU of the "
            f"live workers has {largest:.1f} GiB, {capacity:.1f} GiB admissible after the "
            f"reserve. Lower max_seq_length or the batch size, set load_in_4bit, or lower "
            "vram_budget_gib.", None, code="too_big_for_gpus")


#: What a refused new run can change (:func:`check_job_quota`'s ``remedy``; ``{whose}``: "your",
#: or "alice's" when an admin asks for alice's job).
RUN_REMEDY = ("Lower max_seq_length or the batch size, set load_in_4bit, or ask an admin to raise "
              "{whose} quota (GPU memory at once, on the Admin page).")
#: What a refused job of an existing run or model can change: only the quota.
QUOTA_REMEDY = "Ask an admin to raise {whose} quota (GPU memory at once, on the Admin page)."


def job_quota_refusal(engine: Engine | None, settings: Settings, owner: User | str | None,
                      allocated_gib: float | None, num_gpus: int = 1, what: str = "this run",
                      remedy: str = RUN_REMEDY, actor: User | None = None) -> StudioError | None:
    """The one decision before any GPU job is queued for a user (a new run, a resume, a
    Playground session, a checkpoint eval), also asked by the pages before the click: the
    refusal of a job its owner's GPU memory quota (``users.quota_gib``, "GPU memory at once")
    could never admit, even with no other job of theirs running; None when it could.

    ``owner``: the job's owner (a User, or its id, read with ``engine``); ``allocated_gib``:
    the job's estimated allocator peak per GPU (GiB, the ``estimate_gib`` it is queued with);
    First the holds admission applies to every job of the owner (:func:`held_refusal`: "Jobs
    at once" is 0, or the account is disabled), whatever the job's estimate.
    ``what``: the job as the message names it ("this run"); ``remedy``: the message's last
    sentence (``{whose}`` in it names the quota's owner); ``actor``: who asks, when not the
    owner (an admin resuming a member's run: the message says "alice's quota", not "your").
    The refusal is StudioError(invalid, code ``over_gpu_memory_quota``) naming the need and
    the quota (GiB) when the memory the job would be admitted with on all its ``num_gpus``
    GPUs (:func:`app.store.admission.need_gib`) is more than the quota
    (:func:`app.store.admission.over_gib_quota`, the rule admission applies). No owner, no
    quota or no estimate: None."""
    if owner is None:
        return None
    if isinstance(owner, str):
        with session_scope(engine) as s:
            owner = s.get(User, owner)
        if owner is None:
            return None
    held = held_refusal(owner, what, actor)
    if held is not None or allocated_gib is None or allocated_gib <= 0:
        return held
    per_gpu = admission.need_gib(allocated_gib, settings.gpu_admit_margin, None)
    need = per_gpu * max(1, num_gpus)
    if not admission.over_gib_quota(owner.quota_gib, need):
        return None
    each = f" ({admission.gib(per_gpu)} GiB on each of {num_gpus} GPUs)" if num_gpus > 1 else ""
    whose = "your" if actor is None or actor.id == owner.id else f"{owner.name}'s"
    return StudioError(
        "invalid", f"{what} needs about {admission.gib(need)} GiB of GPU memory at once{each} "
        f"(estimate {allocated_gib:.2f} GiB, plus the {settings.gpu_admit_margin:.0%} "
        f"admission margin and the {CUDA_CONTEXT_GIB:g} GiB CUDA context), more than {whose} "
        f"GPU memory quota of {admission.quota_text(owner.quota_gib)} GiB at once: it could "
        f"never start. {remedy.format(whose=whose)}", None, code="over_gpu_memory_quota")


def held_refusal(owner: User, what: str = "this run", actor: User | None = None
                 ) -> StudioError | None:
    """The refusal of a new job of ``owner`` that admission would hold forever
    (:func:`app.store.admission.hold_kind`): their "Jobs at once" quota (the Admin page's name)
    is 0, an admin's way to pause a user (StudioError invalid, code ``jobs_at_once_zero``), or
    the account is disabled (an admin acting for a disabled user; code ``owner_disabled``);
    None otherwise. ``what``: the job as the message names it; ``actor``: who asks, when not
    the owner (the message then names the owner and the admin's remedy)."""
    kind = admission.hold_kind(owner)
    if kind is None:
        return None
    mine = actor is None or actor.id == owner.id
    if kind == "paused":
        text = ("Jobs at once is 0 for you: ask an admin. No job of yours starts while it is, so "
                f"{what} is not queued." if mine else
                f"Jobs at once is 0 for {owner.name}: raise it on the Admin page. No job of "
                f"{owner.name}'s starts while it is, so {what} is not queued.")
        return StudioError("invalid", text, None, code="jobs_at_once_zero")
    return StudioError("invalid", f"{owner.name}'s account is disabled: enable it on the Admin "
                       f"page first. A disabled account's jobs are held, so {what} is not "
                       "queued.", None, code="owner_disabled")


def check_job_quota(engine: Engine | None, settings: Settings, owner: User | str | None,
                    allocated_gib: float | None, num_gpus: int = 1, what: str = "this run",
                    remedy: str = RUN_REMEDY, actor: User | None = None) -> None:
    """Raise :func:`job_quota_refusal`'s StudioError (invalid, code ``over_gpu_memory_quota``)
    when the owner's GPU memory quota could never admit the job (same arguments)."""
    problem = job_quota_refusal(engine, settings, owner, allocated_gib, num_gpus, what, remedy,
                                actor)
    if problem is not None:
        raise problem


def check_quota(settings: Settings, owner: User | None, est: Estimate | None,
                num_gpus: int = 1) -> None:
    """A new run's :func:`check_job_quota` for its calibrated estimate ``est`` (raises
    StudioError ``over_gpu_memory_quota``; no estimate: only :func:`held_refusal`'s)."""
    known = est is not None and est.total_gib > 0
    check_job_quota(None, settings, owner, est.allocated_gib if known else None, num_gpus)


#: Codes of the refusals above: about the whole spec, not one field (a form shows them on top).
WHOLE_SPEC_CODES = ("too_big_for_gpus", "over_gpu_memory_quota", "jobs_at_once_zero",
                    "owner_disabled")


def for_new_run(engine: Engine, settings: Settings, model: Model, spec: Any,
                run_kind: str, owner: User | None = None) -> float | None:
    """At run creation: the calibrated estimate's allocator peak (GiB) to store on the job, after
    :func:`check_fits` and, for the run's ``owner``, :func:`check_quota` (raise StudioError
    ``too_big_for_gpus`` / ``over_gpu_memory_quota``); None when the shape is unknown."""
    est = estimate(engine, model, spec, job_kind(run_kind))
    check_fits(engine, settings, est)
    check_quota(settings, owner, est, getattr(spec, "num_gpus", 1) or 1)
    return None if est is None else round(est.allocated_gib, 4)


def memory_summary(job: Job | None) -> dict[str, Any]:
    """A job's memory for the run page and ``/api/runs/{id}``, GiB: ``estimate_gib`` (allocator
    peak estimated at creation), ``context_gib`` (the CUDA context added for a GPU), ``peak_gib``
    and ``peak_kind`` (measured: ``gpu`` allocator peak, or ``rss`` on a CPU worker),
    ``reserved_gib`` / ``nvml_gib`` (GPU only) and ``error`` = (estimate - peak) / peak, only when
    the peak was measured on a GPU (an RSS is not what the estimate predicts); ``words``: the
    estimate as every page says it (:func:`app.studio.estimate.memory_words`; None: none)."""
    if job is None:
        return {"estimate_gib": None, "context_gib": CUDA_CONTEXT_GIB, "peak_gib": None,
                "peak_kind": None, "reserved_gib": None, "nvml_gib": None, "error": None,
                "words": None}
    measured = (job.result or {}).get("memory_peak") or {}
    est, peak = job.estimate_gib, job.peak_gib
    error = None
    if est is not None and peak and job.peak_kind == "gpu":
        error = round((est - peak) / peak, 4)
    return {"estimate_gib": est, "context_gib": CUDA_CONTEXT_GIB, "peak_gib": peak,
            "peak_kind": job.peak_kind, "reserved_gib": measured.get("reserved_gib"),
            "nvml_gib": measured.get("nvml_gib"), "error": error,
            "words": memory_words(est, job.kind)}


def metric_peak(job: Job | None, metric: dict[str, Any] | None) -> dict[str, Any] | None:
    """The memory peak the run's newest metric event reports (GiB), for the run page while the
    job has no measured peak of its own: ``{"gib", "step", "running"}``; ``running`` (the job
    is still running) is when the page says "so far" (a cancelled or failed run's peak is
    final: the one measured up to ``step``). None when the job recorded a peak
    (:func:`memory_summary`) or no metric event reported one."""
    if job is None or job.peak_gib is not None or not metric \
            or metric.get("peak_gib") is None:
        return None
    return {"gib": float(metric["peak_gib"]), "step": metric.get("step"),
            "running": job.state in (JobState.QUEUED, JobState.RUNNING)}
