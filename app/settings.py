"""Settings for both processes, read from ``WHETSTONE_*`` environment variables.

Every setting has an embedded default so ``make run`` works on a fresh machine with no
configuration. The same settings object is used by the web process and the worker.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Process settings (environment prefix ``WHETSTONE_``).

    Attributes:
        host: interface the web process binds (``WHETSTONE_HOST``).
        port: TCP port of the web process (``WHETSTONE_PORT``).
        data_dir: root of uploads, runs, exports and the SQLite file (``WHETSTONE_DATA_DIR``).
        database_url: SQLAlchemy URL; empty means ``sqlite:///<data_dir>/whetstone.db``
            (``WHETSTONE_DATABASE_URL``; ``postgresql+psycopg://...`` for Postgres).
        seed_dir: folder laid out like ``shared/data`` from which the demo model
            ``stories260K`` is seeded; empty means download it from the Hugging Face Hub on first use.
        lease_seconds: how long a claimed job stays leased without a heartbeat (seconds).
        heartbeat_seconds: how often the worker renews its lease (seconds).
        orphan_grace_seconds: how long a supervisor's job process may outlive its claim on the
            job (ended, reaped after its heartbeat stopped, e.g. a process stuck in C code that
            holds the interpreter) before it is sent SIGTERM, and as long again before SIGKILL;
            meanwhile its GPU slots admit nothing (seconds).
        stop_grace_seconds: when the worker supervisor stops (Ctrl-C, SIGTERM), how long a job
            process may take to checkpoint and give its job back before it is killed; a killed
            one's job goes back to the queue saying so (seconds).
        sqlite_busy_timeout_seconds: (faults) how long an SQLite writer waits for another's
            write lock before giving up with "database is locked" (seconds; the worker then
            backs off and retries, the web answers 503 "busy, retry").
        max_upload_mb: largest accepted dataset upload (MiB).
        validate_timeout_seconds: time budget of a dataset's background validation (seconds).
        ollama_url: Ollama server used by "push to Ollama" exports.
        llama_cpp_timeout_seconds: wall-clock limit of one llama.cpp step of an export (GGUF
            quantising or verification, run in a child process; seconds): past it the step's
            process is killed and that export fails naming the step.
        import_root: the only server folder under which members may register local models
            (``WHETSTONE_IMPORT_ROOT``; a HF folder or llama2.c files); empty = members register
            Hub ids only. Admins may name any path.

    Accounts and sign-in:
        admin_user: name of the admin that ``admin_password`` creates (``WHETSTONE_ADMIN_USER``).
        admin_password: when set, the admin ``admin_user`` is created, or its password reset, at
            every start (``WHETSTONE_ADMIN_PASSWORD``; for Docker). Empty: the first start with
            no users prints a one-time ``/setup?token=...`` link instead.
        allowed_hosts: ``Host`` header names served (against DNS rebinding;
            ``WHETSTONE_ALLOWED_HOSTS``): empty = the loopback names ``127.0.0.1``,
            ``localhost``, ``[::1]`` plus ``host`` unless it is ``0.0.0.0``/``::``; ``*`` = any;
            else a comma-separated list of names (a port in the header is ignored).
        session_hours: lifetime of a browser session and of an access token (hours).
        login_attempts_per_minute: sign-in attempts allowed per client address and user name
            per minute; more get 429.
        login_attempts_per_address_per_minute: failed sign-in attempts allowed per client
            address per minute across all user names (``/login``, ``/api/login/access-token``
            and the current-password check of ``/account/password``); more get 429.
        forwarded_allow_ips: proxies whose ``X-Forwarded-For``/``X-Forwarded-Proto`` headers are
            trusted for the client address and scheme (``WHETSTONE_FORWARDED_ALLOW_IPS``:
            comma-separated addresses or networks, ``*`` for any); empty = none, the client
            address is the TCP peer's (a spoofed header cannot dodge the sign-in limit).
        secret_key: key that signs session cookies (``WHETSTONE_SECRET_KEY``); empty = generated
            once into ``<data_dir>/secret_key`` (mode 0600).

    GPU admission (worker/supervisor.py, app/store/admission.py):
        gpu_reserve_gib: GiB of every GPU never admitted into (``WHETSTONE_GPU_RESERVE_GIB``):
            a GPU's capacity is its total memory less this (other processes, fragmentation).
        gpu_admit_margin: fraction added to a job's estimate when it is admitted (the estimate's
            error; the job may use its estimate x (1 + margin) + the CUDA context, in GiB).
        fair_share_hours: the window (hours) of GPU time that fair share compares between users.
        simulated_gpus: tests only: ``"2x24"`` makes a supervisor on a CPU box own 2 simulated
            GPUs of 24 GiB each (jobs run on the CPU, admission as on real GPUs); empty = real.
        gpu_sample_seconds: how often a supervisor writes each GPU's figures (utilisation,
            memory, temperature, power, jobs) for the GPU dashboard (seconds; kept two hours).

    Notifications:
        webhook_allow_private: let users' webhooks reach internal addresses (loopback, private,
            link-local / cloud metadata, ...; ``WHETSTONE_WEBHOOK_ALLOW_PRIVATE``); off, such a
            URL is refused when set and the worker, which resolves the host again at each
            delivery, does not send to it.

    Playground:
        playground_idle_seconds: how long a playground session keeps its model loaded (and its
            GPU slot) without a prompt before it ends (seconds).
        playground_yield_seconds: an idle session ends sooner, after this many seconds without
            a prompt, when a queued job waits for the slot it holds (seconds; 0: at once).

    Reward sandbox (custom GRPO reward code runs in a bubblewrap jail, one per batch of
    completions; these limits are the admin's, a submitter cannot change them):
        reward_memory_mb: address space of each sandbox process (MiB); past it the code gets
            MemoryError (``WHETSTONE_REWARD_MEMORY_MB``).
        reward_cpu_seconds: CPU time of each sandbox process per batch (seconds).
        reward_timeout_seconds: wall-clock time of one batch's call, start included (seconds).
        reward_max_processes: processes the reward code may start besides itself.
    """

    model_config = SettingsConfigDict(env_prefix="WHETSTONE_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("data")
    database_url: str = ""
    seed_dir: Path | None = None
    lease_seconds: float = Field(default=60.0, gt=0)
    heartbeat_seconds: float = Field(default=2.0, gt=0)
    orphan_grace_seconds: float = Field(default=10.0, gt=0)
    stop_grace_seconds: float = Field(default=120.0, gt=0)
    reap_interval_seconds: float = Field(default=15.0, gt=0)
    # faults
    sqlite_busy_timeout_seconds: float = Field(default=30.0, gt=0)
    worker_stale_seconds: float = Field(default=30.0, gt=0)
    max_upload_mb: int = Field(default=512, gt=0)
    validate_timeout_seconds: float = Field(default=600.0, gt=0)
    ollama_url: str = "http://127.0.0.1:11434"
    llama_cpp_timeout_seconds: float = Field(default=1800.0, gt=0)
    import_root: Path | None = None
    # accounts and sign-in
    admin_user: str = "admin"
    admin_password: str = ""
    allowed_hosts: str = ""
    session_hours: float = Field(default=168.0, gt=0)
    login_attempts_per_minute: int = Field(default=10, gt=0)
    login_attempts_per_address_per_minute: int = Field(default=30, gt=0)
    forwarded_allow_ips: str = ""
    secret_key: str = ""
    # GPU admission
    gpu_reserve_gib: float = Field(default=2.0, ge=0)
    gpu_admit_margin: float = Field(default=0.25, ge=0)
    fair_share_hours: float = Field(default=24.0, gt=0)
    simulated_gpus: str = ""
    gpu_sample_seconds: float = Field(default=5.0, gt=0)
    playground_idle_seconds: float = Field(default=300.0, gt=0)
    playground_yield_seconds: float = Field(default=15.0, ge=0)
    webhook_allow_private: bool = False
    # reward sandbox
    reward_memory_mb: int = Field(default=1024, ge=64)
    reward_cpu_seconds: int = Field(default=30, ge=1)
    reward_timeout_seconds: float = Field(default=30.0, gt=0)
    reward_max_processes: int = Field(default=16, ge=0)

    @field_validator("import_root", mode="before")
    @classmethod
    def _empty_is_none(cls, v):
        return None if v is None or (isinstance(v, str) and not v.strip()) else v

    @property
    def resolved_database_url(self) -> str:
        """The database URL in force: the setting, or the embedded SQLite file under data_dir."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'whetstone.db').resolve()}"

    @property
    def kernel_cache_dir(self) -> Path:
        """Where job processes keep compiled Triton kernels (``TRITON_CACHE_DIR``, unless the
        environment sets one): ``<data_dir>/cache/triton``, absolute. Under the data dir so the
        compiled kernels survive a container restart (the Docker volume); a job on a fresh cache
        compiles them in its first step (1.7 s of a 4.8 s first step on an H200, call s24-c2)."""
        return (self.data_dir / "cache" / "triton").resolve()

    def ensure_dirs(self) -> None:
        """Create the data dir and its ``uploads``, ``models``, ``runs``, ``exports`` children."""
        for sub in ("", "uploads", "models", "runs", "exports"):
            (self.data_dir / sub).mkdir(parents=True, exist_ok=True)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
