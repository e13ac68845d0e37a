"""The native ``/api`` shapes: pydantic response models, and the JSON-object body reader.

Times are UNIX epoch seconds (float); sizes are bytes. These models are what ``/api/docs``
shows; the routes build them from store rows.
"""
from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from app.store import events, repo
from app.store.schema import Dataset, Model, Run
from app.studio import access
from app.studio import artifacts, calibration, resume, train_time
from app.web.errors import ApiError, request_json


class DatasetOut(BaseModel):
    """A dataset: its file, detected format, valid row count and the last validation report."""

    id: str
    filename: str
    bytes: int
    format: str | None
    rows: int | None
    purpose: str
    status: str
    error: str | None
    report: dict[str, Any] | None
    owner: str | None
    created_at: float


class DatasetList(BaseModel):
    data: list[DatasetOut]


class ModelOut(BaseModel):
    """A registered base model (``status`` ready once its import job prepared it; its folder on
    the server is never shown)."""

    id: str
    name: str
    source: str
    source_ref: str
    status: str
    error: str | None
    chat_template: str | None
    info: dict[str, Any] | None
    owner: str | None = None
    shared: bool = False
    created_at: float


class ModelList(BaseModel):
    data: list[ModelOut]


class ModelDeleted(BaseModel):
    id: str
    name: str
    deleted: bool = True


class MetricsSummary(BaseModel):
    """Count and first/last/min training loss of a run, and its latest metric event."""

    count: int
    first_loss: float | None = None
    last_loss: float | None = None
    min_loss: float | None = None
    latest: dict[str, Any] | None = None


class RunOut(BaseModel):
    """A run with its job's state; ``metrics`` and ``artifacts`` on single-run reads."""

    model_config = ConfigDict(protected_namespaces=())

    id: str
    name: str | None
    kind: str
    model_id: str
    dataset_id: str
    spec: dict[str, Any]
    job_id: int | None
    owner: str | None
    created_at: float
    state: str | None
    error: str | None
    cancel_requested: bool
    started_at: float | None
    finished_at: float | None
    events_url: str
    memory: dict[str, Any] | None = Field(
        default=None, description="GPU memory in GiB: estimate_gib (allocator peak estimated at "
        "creation), context_gib, peak_gib + peak_kind (measured: gpu allocator peak, or rss on a "
        "CPU worker), reserved_gib, nvml_gib, error ((estimate - peak) / peak, GPU only), "
        "words (the estimate as the pages say it: total_gib, short, parts, text)")
    metrics: MetricsSummary | None = None
    artifacts: list[dict[str, Any]] | None = None
    training_time: dict[str, Any] | None = Field(
        default=None, description="seconds in training (single-run reads): all_attempts (the "
        "run's total over every attempt), this_attempt (the newest attempt: the stretch one "
        "process trains now, else the last), attempts (how many: a resume's job, or a claim of "
        "one after a restart, each trains one), resumed, running (the job is training: the figures are so "
        "far, its own stretch up to its newest logged step) (app.studio.train_time)")
    resume: dict[str, Any] | None = Field(
        default=None, description="single-run reads: whether the caller can resume the run now, "
        "as POST /api/runs/{id}/resume would answer: checkpoint_step (where a resume starts; null "
        "without one), can_resume, reason (why not; null when it can) and code (not_resumable, "
        "over_gpu_memory_quota: the owner's GPU memory quota could never admit the job; "
        "jobs_at_once_zero: the owner's Jobs at once quota is 0; owner_disabled; null "
        "when it can) (app.studio.resume.resume_state)")


class RunList(BaseModel):
    data: list[RunOut]


class ExportOut(BaseModel):
    """One export job: status, progress, verification and files (``app.studio.exports``)."""

    id: int
    object: str = "export"
    run_id: str | None
    format: str | None
    quantization: list[str] | str | None
    dtype: str | None
    checkpoint_step: int | None = None
    status: str
    error: str | None
    cancel_requested: bool = False  # POST /api/exports/{id}/cancel seen; the worker is stopping it
    created_at: float
    finished_at: float | None
    progress: dict[str, Any] | None
    verification: dict[str, Any] | None
    files: list[dict[str, Any]]
    ollama: dict[str, Any] | None
    provenance: dict[str, Any] | None = None
    events_url: str


class ExportList(BaseModel):
    object: str = "list"
    data: list[ExportOut]


class ExportQueued(BaseModel):
    id: int
    status: str


def dataset_out(ds: Dataset) -> DatasetOut:
    return DatasetOut.model_validate(ds.model_dump())


def model_out(m: Model, user) -> ModelOut:
    """A model for ``user``: a server path in ``source_ref`` (local folder, llama2.c files) only
    for its owner or an admin; others see the Hub id, or an empty reference."""
    out = ModelOut.model_validate(m.model_dump())
    if m.source != "hf" and not access.can_see(user, m.owner):
        out.source_ref = ""
    return out


def metrics_summary(engine, job_id: int | None) -> MetricsSummary:
    """Count, first/last/min loss and the latest metric event of a job."""
    if job_id is None:
        return MetricsSummary(count=0)
    losses, latest, last = [], None, 0
    while True:
        batch = events.since(engine, job_id, last, 5000, types=["metric"])
        if not batch:
            break
        for ev in batch:
            if isinstance(ev.data.get("loss"), (int, float)):
                losses.append(ev.data["loss"])
            latest = ev.data
        last = batch[-1].id
    return MetricsSummary(count=len(losses), first_loss=losses[0] if losses else None,
                          last_loss=losses[-1] if losses else None,
                          min_loss=min(losses) if losses else None, latest=latest)


def run_out(engine, run: Run, full: bool = False, settings=None, user=None) -> RunOut:
    """A run as the JSON API shows it (job state, timestamps; metrics, artifacts, training
    time if ``full``, and with ``settings`` whether ``user`` can resume it)."""
    _, job = repo.run_with_job(engine, run.id)
    out = RunOut(**run.model_dump(exclude={"output_dir"}), state=job.state if job else None,
                 error=job.error if job else None,
                 cancel_requested=bool(job and job.cancel_requested),
                 started_at=job.started_at if job else None,
                 finished_at=job.finished_at if job else None,
                 events_url=f"/runs/{run.id}/events", memory=calibration.memory_summary(job))
    if full:
        out.metrics = metrics_summary(engine, run.job_id)
        out.artifacts = [artifacts.public(a) for a in artifacts.present(engine, run.id)]
        out.training_time = train_time.training_time(engine, job)
        if settings is not None:
            out.resume = resume.resume_state(engine, settings, user, run, job)
    return out


async def json_object(request: Request, what: str = "a JSON object") -> dict[str, Any]:
    """The request body, which must be a JSON object. Raises ApiError 400."""
    body = await request_json(request)
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be {what}")
    return body


class CheckpointEvalOut(BaseModel):
    """One on-demand eval of a run's checkpoint (``app.studio.checkpoint_eval``): the table is
    ``generation_eval`` (SFT) or ``reward_eval`` (GRPO) once ``status`` is succeeded."""

    id: int
    object: str = "checkpoint_eval"
    run_id: str | None
    checkpoint_step: int | None
    samples: int | None
    status: str
    error: str | None
    cancel_requested: bool = False  # POST /api/evaluations/{id}/cancel seen; it is stopping
    created_at: float
    finished_at: float | None
    held_out: dict[str, Any] | None = None
    generation_eval: dict[str, Any] | None = None
    reward_eval: dict[str, Any] | None = None


class RunEvaluationsOut(BaseModel):
    """Everything evaluated of a run: ``held_out`` (where the held-out set comes from),
    ``end_of_run`` (``eval``, ``generation_eval``, ``reward_eval`` of the training job),
    ``checkpoints`` on disk (``step``, ``can_evaluate``, ``reason``, ``code``, ``evaluation``:
    its queued or running eval's ``{"id", "status"}`` or None) and ``evals`` of them."""

    run_id: str
    kind: str
    held_out: str | None
    end_of_run: dict[str, Any]
    checkpoints: list[dict[str, Any]]
    evals: list[CheckpointEvalOut]
    active: bool
    default_samples: int
