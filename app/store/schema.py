"""The database schema: every table both processes share (SQLModel, SQLite or Postgres).

Times are UNIX epoch seconds (float, UTC) so that lease arithmetic is plain SQL on every
backend. Free-form payloads are JSON columns. String ids carry a kind prefix that users see
(``file-``, ``ftjob-``, ``model-``, ``art-``, ``user-``, ``key-``), in the style of the OpenAI
fine-tuning API.
"""
from __future__ import annotations

import secrets
import time
from typing import Any

from sqlalchemy import JSON, Column, Index, Text
from sqlmodel import Field, SQLModel


def now() -> float:
    """Current time as UNIX epoch seconds (float)."""
    return time.time()


def new_id(prefix: str) -> str:
    """A random, URL-safe id such as ``ftjob-3f9a0c1b2d4e5f60`` (prefix + 16 hex digits)."""
    return f"{prefix}-{secrets.token_hex(8)}"


class JobState:
    """Job states: queued -> running -> succeeded | failed | cancelled."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    FINAL = (SUCCEEDED, FAILED, CANCELLED)


class Dataset(SQLModel, table=True):
    """An uploaded dataset file; ``report`` holds the last validation report (JSON)."""

    __tablename__ = "datasets"
    id: str = Field(default_factory=lambda: new_id("file"), primary_key=True)
    filename: str
    path: str
    bytes: int = 0
    format: str | None = None
    rows: int | None = None
    purpose: str = "fine-tune"
    status: str = "processed"  # processed | error
    error: str | None = Field(default=None, sa_column=Column(Text))
    report: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    owner: str | None = None
    created_at: float = Field(default_factory=now)


class Model(SQLModel, table=True):
    """A registered base model: a Hub id, a local HF folder or a llama2.c checkpoint.

    ``path`` is the local Hugging Face folder the worker trains from once ``status`` is
    ``ready``; ``chat_template`` is the model's own template, if it has one.
    """

    __tablename__ = "models"
    __table_args__ = (Index("uq_models_owner_name", "owner", "name", unique=True),)
    id: str = Field(default_factory=lambda: new_id("model"), primary_key=True)
    name: str = Field(index=True)  # unique per owner (uq_models_owner_name)
    source: str  # hf | local | llama2c
    source_ref: str  # Hub id, folder path, or "<checkpoint.bin>|<tokenizer.bin>"
    path: str | None = None
    status: str = "pending"  # pending | ready | failed
    error: str | None = Field(default=None, sa_column=Column(Text))
    chat_template: str | None = Field(default=None, sa_column=Column(Text))
    info: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    owner: str | None = None
    shared: bool = False  # visible to every user (the seeded demo model is)
    created_at: float = Field(default_factory=now)


class Run(SQLModel, table=True):
    """One fine-tuning run (SFT or GRPO); its spec is the resolved, versioned payload."""

    __tablename__ = "runs"
    id: str = Field(default_factory=lambda: new_id("ftjob"), primary_key=True)
    name: str | None = None
    kind: str = "sft"  # sft | grpo
    model_id: str = Field(foreign_key="models.id", index=True)
    dataset_id: str = Field(foreign_key="datasets.id", index=True)
    spec: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    job_id: int | None = Field(default=None, index=True)
    output_dir: str | None = None
    owner: str | None = None
    created_at: float = Field(default_factory=now)


class Job(SQLModel, table=True):
    """A queue entry. All state changes go through ``app.store.queue``."""

    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_state_priority", "state", "priority", "id"),)
    id: int | None = Field(default=None, primary_key=True)
    kind: str  # train | grpo | export | import_model
    payload: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    state: str = Field(default=JobState.QUEUED)
    priority: int = 0
    attempts: int = 0
    max_attempts: int = 3
    lease_owner: str | None = None
    lease_expires_at: float | None = None
    cancel_requested: bool = False
    owner: str | None = None
    run_id: str | None = Field(default=None, index=True)
    created_at: float = Field(default_factory=now)
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = Field(default=None, sa_column=Column(Text))
    result: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    # memory (GiB): the allocator peak estimated at creation (app.studio.estimate, calibrated)
    # and the one measured (peak_kind "gpu": torch max_memory_allocated; "rss": the CPU process)
    estimate_gib: float | None = None
    peak_gib: float | None = None
    peak_kind: str | None = None
    # admission (app.store.admission): the GPU slot (its worker row id), the device index on its
    # host and the GiB reserved there while the job runs; front_at: an admin moved it to the front
    gpu_slot: str | None = Field(default=None, index=True)
    gpu_index: int | None = None
    admitted_gib: float | None = None
    front_at: float | None = None


class JobEvent(SQLModel, table=True):
    """Append-only job event: ``type`` in state | metric | log | progress | sample."""

    __tablename__ = "job_events"
    id: int | None = Field(default=None, primary_key=True)
    job_id: int = Field(index=True)
    ts: float = Field(default_factory=now)
    type: str
    data: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))


class Artifact(SQLModel, table=True):
    """A file a job produced (adapter, config.json, checkpoint, export), under data_dir."""

    __tablename__ = "artifacts"
    id: str = Field(default_factory=lambda: new_id("art"), primary_key=True)
    run_id: str | None = Field(default=None, index=True)
    job_id: int | None = Field(default=None, index=True)
    kind: str  # adapter | config | checkpoint | merged_16bit | gguf | ollama | log
    name: str
    path: str
    bytes: int = 0
    sha256: str | None = None
    meta: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    created_at: float = Field(default_factory=now)


class Worker(SQLModel, table=True):
    """A live worker process, refreshed by its heartbeat; shown by ``/healthz``."""

    __tablename__ = "workers"
    id: str = Field(primary_key=True)
    host: str
    pid: int
    device: str
    started_at: float = Field(default_factory=now)
    last_seen: float = Field(default_factory=now)
    current_job_id: int | None = None
    gpu_total_gib: float | None = None  # total memory of its GPU (GiB); None on the CPU
    # a supervisor's GPU slot (worker/supervisor.py): device index on its host, and the GiB jobs
    # may be admitted into (total less the reserve); None for a plain worker or lane
    gpu_index: int | None = None
    gpu_capacity_gib: float | None = None


class GpuSample(SQLModel, table=True):
    """One GPU's figures at one moment, written by its supervisor every
    ``settings.gpu_sample_seconds`` and kept for :data:`app.store.gpu_samples.KEEP_SECONDS`.

    ``source`` says where the figures came from: ``nvml`` (a real GPU), ``simulated`` (tests:
    memory used is the sum admitted there, the rest unknown) or ``cpu`` (a box without a GPU: the
    host's CPU utilisation and RAM). Unknown figures are None. ``jobs`` lists the ids of the jobs
    running there at that moment."""

    __tablename__ = "gpu_samples"
    __table_args__ = (Index("ix_gpu_samples_slot_ts", "slot", "ts"),)
    id: int | None = Field(default=None, primary_key=True)
    ts: float = Field(default_factory=now, index=True)
    slot: str  # the GPU slot's worker row id, e.g. "box-gpu0"
    host: str
    gpu_index: int | None = None
    name: str = ""  # device label, e.g. "cuda:0 NVIDIA H200"
    source: str = "nvml"  # nvml | simulated | cpu
    util_pct: float | None = None  # utilisation, percent
    mem_used_gib: float | None = None
    mem_total_gib: float | None = None
    temp_c: float | None = None  # degrees Celsius
    power_w: float | None = None  # watts
    jobs: list[int] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))


class User(SQLModel, table=True):
    """A person who signs in; ``role`` is ``admin`` or ``member``. The ``owner`` columns of
    datasets, models, runs and jobs hold a user's ``id``."""

    __tablename__ = "users"
    id: str = Field(default_factory=lambda: new_id("user"), primary_key=True)
    name: str = Field(index=True, unique=True)
    password_hash: str
    role: str = "member"  # admin | member
    disabled: bool = False
    can_run_custom_rewards: bool = False
    # quotas set by an admin (None: no limit) and the fair-share weight (app.store.admission)
    quota_jobs: int | None = None  # GPU jobs running at once
    quota_gib: float | None = None  # GPU memory admitted at once (GiB)
    quota_gpu_hours: float | None = None  # GPU-hours in the last 24 hours
    share_weight: float = 1.0
    # where the worker POSTs a run's end (succeeded, failed, cancelled); None: no notification
    webhook_url: str | None = Field(default=None, sa_column=Column(Text))
    # the key that signs its deliveries (``whsec_...``, shown to the user once; migration 0008)
    webhook_secret: str | None = Field(default=None, sa_column=Column(Text))
    created_at: float = Field(default_factory=now)
    last_seen_at: float | None = None


class ApiKey(SQLModel, table=True):
    """A user's API key: only its sha256 (hex) is stored; ``prefix`` is the start shown in the UI."""

    __tablename__ = "api_keys"
    id: str = Field(default_factory=lambda: new_id("key"), primary_key=True)
    user_id: str = Field(index=True)
    name: str
    prefix: str
    key_hash: str = Field(index=True, unique=True)
    created_at: float = Field(default_factory=now)
    last_used_at: float | None = None
    revoked_at: float | None = None


class AuthToken(SQLModel, table=True):
    """A server-side sign-in: a browser ``session`` or a Bearer ``access`` token (sha256 stored),
    so sign-out and disabling a user end it at once."""

    __tablename__ = "auth_tokens"
    id: str = Field(default_factory=lambda: new_id("tok"), primary_key=True)
    token_hash: str = Field(index=True, unique=True)
    user_id: str = Field(index=True)
    kind: str = "session"  # session | access
    csrf_token: str = Field(default_factory=lambda: secrets.token_urlsafe(32))
    created_at: float = Field(default_factory=now)
    expires_at: float


class AuditEvent(SQLModel, table=True):
    """Who did what to which object, when (append-only)."""

    __tablename__ = "audit_events"
    id: int | None = Field(default=None, primary_key=True)
    ts: float = Field(default_factory=now, index=True)
    user_id: str | None = Field(default=None, index=True)
    action: str
    object_type: str | None = None
    object_id: str | None = None
    detail: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
