"""What the training jobs (``train`` SFT and ``grpo``) share: the job prelude (payload -> spec,
ready model and dataset rows, device checks, the run folder), the LoRA model, ``config.json``,
resuming from a checkpoint and saving + zipping the final adapter as an artifact.

Both jobs write the same run-folder layout (see :mod:`worker.jobs.train`), so export works on
either.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import shutil
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.store import repo
from app.store.schema import Artifact, Dataset, Model
from worker import gpu
from worker.checkpoints import newest_complete
from worker.context import JobCancelled, JobContext, JobError, WorkerShutdown


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def frozen_gc():
    """Run the body (a training loop) with every object that exists now (the model, its modules,
    the tokenizer, the dataset) moved out of Python's cyclic GC (``gc.freeze``): a full collection
    then scans only what training creates. On the H200 bench one full collection over the loaded
    Llama-8B process took 0.28 s inside a 0.33 s step (bench/results.jsonl s5-c2). The objects
    return to the collector afterwards (``gc.unfreeze``), so a long-lived worker frees them."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file and a rename (never half-written)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def zip_folder(folder: Path, dest: Path) -> None:
    """Zip ``folder`` (entries under its own name) to ``dest`` through a temp file."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                zf.write(f, Path(folder.name) / f.relative_to(folder))
    os.replace(tmp, dest)


def versions() -> dict[str, str]:
    """Versions of the training libraries that are importable."""
    out = {}
    for name in ("torch", "transformers", "peft", "trl", "datasets"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            pass
    return out


def add_artifact(ctx: JobContext, run_id: str, kind: str, path: Path, **meta: Any) -> None:
    """Record ``path`` as an artifact of the run (size, SHA-256, optional meta)."""
    repo.add_artifact(ctx.engine, Artifact(run_id=run_id, job_id=ctx.job.id, kind=kind,
                                           name=path.name, path=str(path),
                                           bytes=path.stat().st_size, sha256=sha256(path),
                                           meta=meta or None))


# ---- the job prelude ------------------------------------------------------------------------
def owner_may_run_custom_rewards(ctx: JobContext) -> bool:
    """Whether the job's owner may (still) run custom reward code: the same rule the web applied
    when the run was created (:func:`app.studio.grpo.custom_rewards_allowed`), read again from
    the owner's user row, so revoking the permission stops queued runs too."""
    from app.store.db import session_scope
    from app.store.schema import User
    from app.studio.grpo import custom_rewards_allowed

    if not ctx.job.owner:
        return False
    with session_scope(ctx.engine) as s:
        user = s.get(User, ctx.job.owner)
        return user is not None and not user.disabled and custom_rewards_allowed(user)


def job_spec(ctx: JobContext, spec_cls, job_name: str) -> tuple[str, Any]:
    """(run id, validated spec) of the job's run: the payload names the run (``run_id``) and the
    run row holds the one copy of the spec.

    A payload written before that (the spec's fields beside ``run_id``) is still read as a spec.
    Raises JobError when there is no run id or no such run; pydantic.ValidationError on a bad spec.
    """
    payload = dict(ctx.payload)
    run_id = payload.pop("run_id", None) or ctx.job.run_id
    if not run_id:
        raise JobError(f"{job_name} job payload has no run_id")
    if set(payload) <= {"spec_version"}:
        try:
            return run_id, admitted_budget(
                ctx, spec_cls.model_validate(repo.get_run(ctx.engine, run_id).spec))
        except repo.NotFound:
            raise JobError(f"{job_name} job: run {run_id} no longer exists") from None
    return run_id, admitted_budget(ctx, spec_cls.model_validate(payload))


def admitted_budget(ctx: JobContext, spec):
    """``spec`` with ``vram_budget_gib`` at most the GPU memory the job was admitted with (GiB,
    less the CUDA context; ``jobs.admitted_gib``, set by a supervisor's admission), so that
    budgeted checkpointing keeps only the activations that fit there. Unchanged off a GPU or
    without an admission."""
    from app.studio.estimate import CUDA_CONTEXT_GIB

    gib = ctx.job.admitted_gib
    if gib is None or ctx.job.gpu_index is None or not hasattr(spec, "vram_budget_gib") \
            or not gpu.cuda_available():
        return spec
    budget = round(max(0.5, gib - CUDA_CONTEXT_GIB), 2)
    if spec.vram_budget_gib is not None and spec.vram_budget_gib <= budget:
        return spec
    ctx.log(f"admitted with {gib:.1f} GiB on GPU {ctx.job.gpu_index}: vram_budget_gib {budget}")
    return spec.model_copy(update={"vram_budget_gib": budget})


def job_inputs(ctx: JobContext, spec) -> tuple[Model, Dataset]:
    """The spec's model row (which must be ready) and dataset row. Raises JobError (the model
    is not ready; the dataset was deleted, as a user may while no job of the run is queued or
    running, so only a delete racing the job's queueing meets it) or NotFound."""
    model_row = repo.get_model(ctx.engine, spec.model)
    if model_row.status != "ready" or not model_row.path:
        raise JobError(f"model {model_row.name} is not ready (status {model_row.status}"
                       f"{': ' + model_row.error if model_row.error else ''})")
    try:
        return model_row, repo.get_dataset(ctx.engine, spec.dataset)
    except repo.NotFound:
        gone = repo.get_dataset(ctx.engine, spec.dataset, deleted=True)
        raise JobError(f"dataset {gone.filename} was deleted; clone the run and pick another "
                       "dataset") from None


def check_device(spec) -> bool:
    """Whether CUDA is available; raises JobError for QLoRA (load_in_4bit) without it."""
    cuda = gpu.cuda_available()
    if spec.load_in_4bit and not cuda:
        raise JobError("QLoRA (load_in_4bit) needs a CUDA GPU with bitsandbytes; this worker "
                       "runs on the CPU. Turn load_in_4bit off to train LoRA in full precision.")
    return cuda


def open_run_dir(ctx: JobContext, run_id: str) -> tuple[Path, Path]:
    """(run folder, its checkpoints folder), created and recorded as the run's output."""
    run_dir = (ctx.settings.data_dir / "runs" / run_id).resolve()
    ckpt_dir = run_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    repo.set_run_output(ctx.engine, run_id, str(run_dir))
    return run_dir, ckpt_dir


def lora_model(ctx: JobContext, spec, model_row: Model, cuda: bool,
               on_log: Callable[[str], None] | None = None, added=None):
    """(model with LoRA, resolved optimizer name): seeds, loads the base model, adds the adapter.

    An optimizer the device cannot run is replaced (with a warning). ``on_log`` goes to
    :func:`worker.engine.sft.add_lora`. ``added``: the run's added tokens
    (:class:`worker.jobs.added_tokens.AddedTokens`): their embedding rows are appended before
    LoRA and trained with ``trainable_token_indices``. Raises JobError when loading fails.
    """
    from worker.engine import sft

    optim, warn = sft.resolve_optim(spec.optim, cuda)
    if warn:
        ctx.log(warn, "warning")
    import transformers

    transformers.set_seed(spec.seed)
    try:
        model = sft.load_model(model_row.path, spec.load_in_4bit, cuda)
        if added is not None and added.ids:
            from worker.jobs.added_tokens import grow

            grow(model, added)
        model = sft.add_lora(model, spec, on_log=on_log,
                             new_token_ids=added.ids if added is not None else None)
    except RuntimeError as e:
        raise JobError(str(e)) from e
    return model, optim


def log_lora(ctx: JobContext, spec, model, suffix: str = "") -> int:
    """Log the LoRA shape and trainable parameter count; returns the trainable count."""
    trainable, total = model.get_nb_trainable_parameters()
    ctx.log(f"LoRA r={spec.r} alpha={spec.lora_alpha} on {', '.join(spec.target_modules)}: "
            f"{trainable} trainable of {total} parameters" + suffix)
    return trainable


# ---- config.json, resume, adapter -----------------------------------------------------------
def run_name(ctx: JobContext, run_id: str) -> str | None:
    """The run's user-given name (None when it has none or the row is gone)."""
    try:
        return repo.get_run(ctx.engine, run_id).name
    except repo.NotFound:
        return None


def model_config_entry(model_row: Model) -> dict[str, Any]:
    """The ``model`` entry of config.json (a downloadable record: no server paths)."""
    from worker.jobs.card import base_model_id

    return {"id": model_row.id, "name": model_row.name, "base_model": base_model_id(model_row),
            "source": model_row.source, "info": model_row.info}


def training_arguments(args, saved=None) -> dict[str, Any]:
    """The scalar entries of a TrainingArguments (for config.json, a downloadable record: the
    folders on the server, such as ``output_dir``, are left out). ``saved``: the job's
    :func:`worker.checkpoints.recorder`, whose ``save_total_limit`` it shows (the recorder
    applies it in the trainer's place)."""
    out = {k: v for k, v in args.to_dict().items()
           if isinstance(v, (int, float, str, bool, type(None)))
           and not (isinstance(v, str) and os.path.isabs(v))}
    if saved is not None and saved.keep is not None:
        out["save_total_limit"] = saved.keep
    return out


def write_config(ctx: JobContext, run_id: str, run_dir: Path, config: dict[str, Any]) -> None:
    """Write ``config.json`` (plus library versions) and record it once as the ``config``
    artifact."""
    config = {**config, "versions": versions()}
    atomic_write(run_dir / "config.json", json.dumps(config, indent=2, default=str))
    if not repo.list_artifacts(ctx.engine, run_id, kind="config"):
        add_artifact(ctx, run_id, "config", run_dir / "config.json")


def train(ctx: JobContext, trainer, callback, last: str | None, single: bool) -> tuple[Any, float]:
    """``trainer.train(resume_from_checkpoint=last)`` under :func:`frozen_gc`, then this
    attempt's segment recorded (:func:`record_segment`); returns (the train output, seconds).

    ``callback`` is the job's :func:`worker.engine.callbacks.stopping_callback`. A stop at a
    step's end has the trainer save a checkpoint there. A cancel or shutdown raised inside a
    step (GRPO's rollout checks the job's stop flags, so a stop does not wait for a long
    generation) leaves the trainer at its last completed step; for a ``single``-process run
    that step is saved as a checkpoint too (unless it is already, or no step was trained in
    this attempt), recorded by the job's checkpoint callback, so Resume redoes only the
    abandoned step; then the segment is recorded and the stop raised again. A lost lease
    saves nothing (the job may be another worker's by now). A rank of a data-parallel run does
    not save (a checkpoint there needs every rank, and the others may be inside a collective):
    the log says the steps since the newest checkpoint are lost.

    Raises: what ``trainer.train`` raises (JobCancelled, WorkerShutdown, LeaseLost, ...)."""
    t0 = time.monotonic()
    try:
        with frozen_gc():
            out = trainer.train(resume_from_checkpoint=last)
    except (JobCancelled, WorkerShutdown) as stop:
        runtime = time.monotonic() - t0
        state, reason = trainer.state, "cancelled" if isinstance(stop, JobCancelled) \
            else "shutdown"
        step = int(state.global_step)
        folder = Path(trainer.args.output_dir) / f"checkpoint-{step}"
        if step > callback.start_step and not folder.is_dir():
            if single:
                ctx.log(f"stopping training ({reason}) during step {step + 1}, whose rollout "
                        f"is abandoned; saving checkpoint-{step}")
                trainer._save_checkpoint(trainer.model, trial=None)
                trainer.control = trainer.callback_handler.on_save(trainer.args, state,
                                                                   trainer.control)
            else:
                ctx.log(f"stopping training ({reason}) during step {step + 1}; steps "
                        f"{callback.start_step + 1}-{step} of this data-parallel run are not "
                        "saved (no checkpoint mid-step across ranks)", "warning")
        record_segment(ctx, callback.start_step, state, runtime)
        raise
    runtime = time.monotonic() - t0
    record_segment(ctx, callback.start_step, trainer.state, runtime)
    return out, runtime


def record_segment(ctx: JobContext, start_step: int, state, runtime: float) -> None:
    """Record this attempt's stretch of training as a log event (written before a cancel or
    shutdown raises, so a stopped attempt is recorded too): ``segment = {"job_id",
    "from_step", "to_step", "train_runtime"}`` (seconds in ``trainer.train``). A resumed job
    carries the earlier jobs' log events (:func:`app.store.repo.resume_run`), so the run's
    total training time is the sum over its segments (:mod:`app.studio.train_time`)."""
    ctx.log(f"trained steps {start_step + 1}-{state.global_step} in {runtime:.1f}s",
            segment={"job_id": ctx.job.id, "from_step": int(start_step),
                     "to_step": int(state.global_step), "train_runtime": round(runtime, 3)})


def training_ended(ctx: JobContext, callback, state) -> None:
    """After ``trainer.train()`` returned: when ``callback`` (a
    :func:`worker.engine.callbacks.stopping_callback`) did not stop it, training ended on its
    own and a cancel requested by now came too late (the job finishes and says so:
    :meth:`JobContext.cancel_came_too_late`); then :meth:`JobContext.check` (raises for the
    cancel, shutdown or lost lease that stopped it)."""
    if callback.stopped is None:
        ctx.cancel_came_too_late(state.global_step, state.max_steps)
    ctx.check()


def last_checkpoint(ctx: JobContext, ckpt_dir: Path) -> str | None:
    """The newest COMPLETE checkpoint of an earlier attempt (logged), or None; incomplete newer
    ones (a save cut short by a kill or a full disk) are set aside with a warning
    (:func:`worker.checkpoints.newest_complete`)."""
    last = newest_complete(ckpt_dir, on_skip=lambda msg: ctx.log(msg, "warning"))
    if last:
        step = last.name.rpartition("-")[2]
        # the step, as data: the run's training time starts this attempt there (app.studio.train_time)
        ctx.log(f"resuming from {last.name}", **({"resume_step": int(step)} if step.isdecimal() else {}))
    return str(last) if last else None


def earlier_metric(ctx: JobContext, start_step: int, key: str, first_step: int = 1) -> dict[int, float]:
    """``{step: value}`` of the job's metric events that carry the number ``key`` at
    ``first_step <= step <= start_step``: what earlier attempts of a resumed run recorded up to
    the checkpoint this attempt started from (a resumed job carries them, see
    :func:`with_earlier_losses`). Empty for a fresh start (``start_step`` 0)."""
    from app.store import events

    out: dict[int, float] = {}
    if start_step <= 0:
        return out
    for ev in events.since(ctx.engine, ctx.job.id, 0, 1_000_000, types=["metric"]):
        step, value = ev.data.get("step"), ev.data.get(key)
        if isinstance(step, int) and first_step <= step <= start_step \
                and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[step] = float(value)
    return out


def with_earlier_losses(ctx: JobContext, start_step: int, losses: list[tuple[int, float]],
                        training_loss: float, global_step: int
                        ) -> tuple[list[tuple[int, float]], float]:
    """(every logged ``(step, loss)`` of the run, its mean training loss) for a job that
    resumed at ``start_step``: the job carries the earlier attempt's metric events up to its
    checkpoint (:func:`app.store.repo.resume_run`; a requeued job its own), and transformers'
    ``training_loss`` averages only this attempt's step losses over all ``global_step`` steps.
    Each earlier logged loss counts for the steps since the one logged before it (exact with
    ``logging_steps=1``). Unchanged for a fresh start."""
    if start_step <= 0 or global_step <= 0:
        return losses, training_loss
    earlier = earlier_metric(ctx, start_step, "loss")
    total, done = 0.0, 0
    for step in sorted(earlier):
        total, done = total + earlier[step] * (step - done), step
    return (sorted(earlier.items()) + list(losses),
            (training_loss * global_step + total) / global_step)


def save_adapter(ctx: JobContext, run_id: str, run_dir: Path, trainer, tokenizer,
                 template: str | None, model_row: Model, card: str) -> tuple[Path, Path]:
    """Save the final adapter (+ tokenizer, chat template, the model card ``card`` as README.md)
    to ``adapter/`` through a temp folder, with ``base_model_name_or_path`` naming the base as
    others can load it (:mod:`worker.jobs.card`); zip it to ``adapter.zip`` and record the
    ``adapter`` artifact. Returns (folder, zip)."""
    from worker.jobs.card import make_portable

    ctx.progress("save", 0, 1, "saving the adapter")
    adapter_dir = run_dir / "adapter"
    tmp = run_dir / f".adapter.tmp-{ctx.job.id}"
    shutil.rmtree(tmp, ignore_errors=True)
    # added tokens (add_template_tokens): their rows are the trainable_tokens_delta; PEFT would
    # also save the whole resized embedding (vocab x hidden), which an export rebuilds anyway
    cfg = getattr(trainer.model, "peft_config", {}).get("default")
    whole = False if getattr(cfg, "trainable_token_indices", None) else "auto"
    trainer.model.save_pretrained(str(tmp), safe_serialization=True, save_embedding_layers=whole)
    tokenizer.save_pretrained(str(tmp))
    if template and not (tmp / "chat_template.jinja").exists():
        (tmp / "chat_template.jinja").write_text(template, encoding="utf-8")
    make_portable(tmp, model_row)
    (tmp / "README.md").write_text(card, encoding="utf-8")
    shutil.rmtree(adapter_dir, ignore_errors=True)
    tmp.rename(adapter_dir)
    zip_path = run_dir / "adapter.zip"
    zip_folder(adapter_dir, zip_path)
    add_artifact(ctx, run_id, "adapter", zip_path, folder=str(adapter_dir), format="peft")
    ctx.progress("save", 1, 1)
    return adapter_dir, zip_path
