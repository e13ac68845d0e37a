"""The ``train`` job: LoRA SFT of a registered model on an uploaded dataset.

Payload: the fields of :class:`app.store.specs.TrainSpec` plus ``run_id``. Writes under
``<data_dir>/runs/<run_id>/``:

* ``config.json``: the resolved spec, the model, the dataset counts, the chat template used,
  the training arguments and library versions (artifact ``config``);
* ``checkpoints/checkpoint-<step>/``: the trainer's own checkpoints (adapter + optimizer,
  scheduler, RNG state); a requeued job resumes from the newest one;
* ``adapter/``: the final PEFT adapter (adapter_config.json, adapter_model.safetensors,
  tokenizer files, chat_template.jinja), written to a temp folder and renamed;
* ``adapter.zip``: the same folder zipped, for download (artifact ``adapter``).

Result: ``{"final_loss", "train_loss", "steps", "train_runtime", "tokens", "trained_tokens",
"rows", "adapter_dir", "adapter_zip"}``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any

from app.store import repo
from app.store.schema import Artifact
from app.store.specs import TrainSpec
from worker import gpu
from worker.context import JobContext, JobError


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _zip_folder(folder: Path, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                zf.write(f, Path(folder.name) / f.relative_to(folder))
    os.replace(tmp, dest)


def _versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "transformers", "peft", "trl", "datasets"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            pass
    return out


def _artifact(ctx: JobContext, run_id: str, kind: str, path: Path, **meta: Any) -> None:
    repo.add_artifact(ctx.engine, Artifact(run_id=run_id, job_id=ctx.job.id, kind=kind,
                                           name=path.name, path=str(path),
                                           bytes=path.stat().st_size, sha256=_sha256(path),
                                           meta=meta or None))


def run(ctx: JobContext) -> dict[str, Any]:
    payload = dict(ctx.payload)
    run_id = payload.pop("run_id", None) or ctx.job.run_id
    if not run_id:
        raise JobError("train job payload has no run_id")
    spec = TrainSpec.model_validate(payload)
    model_row = repo.get_model(ctx.engine, spec.model)
    if model_row.status != "ready" or not model_row.path:
        raise JobError(f"model {model_row.name} is not ready (status {model_row.status}"
                       f"{': ' + model_row.error if model_row.error else ''})")
    ds_row = repo.get_dataset(ctx.engine, spec.dataset)

    from worker.engine import data as edata
    from worker.engine import sft

    cuda = gpu.cuda_available()
    if spec.load_in_4bit and not cuda:
        raise JobError("QLoRA (load_in_4bit) needs a CUDA GPU with bitsandbytes; this worker "
                       "runs on the CPU. Turn load_in_4bit off to train LoRA in full precision.")
    run_dir = (ctx.settings.data_dir / "runs" / run_id).resolve()
    ckpt_dir = run_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    repo.set_run_output(ctx.engine, run_id, str(run_dir))
    ctx.log(f"training on {gpu.device_name()}" + (
        " with the kernel engine (fused LoRA, Triton kernels)" if sft.use_engine(cuda) else ""))

    # ---- data (same encoding as the web preview) ----------------------------------------
    chosen = edata.choose_template(spec.chat_template, model_row.chat_template)
    if chosen.note:
        ctx.log(chosen.note, "warning")
    ctx.progress("tokenize", 0, ds_row.rows or 0, "encoding the dataset")
    from app.data.errors import DatasetError

    try:
        enc = edata.build_dataset(ds_row.path, model_row.path, chosen.source, spec.max_seq_length,
                                  spec.train_on_responses_only, spec.dataset_format or None,
                                  check=ctx.check,
                                  progress=lambda n: ctx.progress("tokenize", n, ds_row.rows or 0))
    except DatasetError as e:
        raise JobError(f"dataset {ds_row.filename}: {e}") from e
    ctx.progress("tokenize", enc.rows, enc.rows)
    ctx.log(f"{enc.rows} training rows, {enc.tokens} tokens ({enc.trained_tokens} trained)"
            + (f", {enc.truncated} truncated to {spec.max_seq_length}" if enc.truncated else ""))
    ctx.check()

    # ---- model, LoRA, trainer -----------------------------------------------------------
    optim, warn = sft.resolve_optim(spec.optim, cuda)
    if warn:
        ctx.log(warn, "warning")
    import transformers

    transformers.set_seed(spec.seed)
    try:
        model = sft.load_model(model_row.path, spec.load_in_4bit, cuda)
        model = sft.add_lora(model, spec, on_log=ctx.log)
    except RuntimeError as e:
        raise JobError(str(e)) from e
    tokenizer = sft.load_tokenizer(model_row.path, chosen.source)
    # the engine checkpoints its own layers (budgeted, offloaded); HF's would run a second time
    args = sft.sft_config(spec, str(ckpt_dir), cuda, optim,
                          **({"gradient_checkpointing": False} if sft.use_engine(cuda) else {}))
    trainable, total = model.get_nb_trainable_parameters()
    ctx.log(f"LoRA r={spec.r} alpha={spec.lora_alpha} on {', '.join(spec.target_modules)}: "
            f"{trainable} trainable of {total} parameters")
    callback = sft.progress_callback(ctx.metric, ctx.stop_reason,
                                     on_stop=lambda r: ctx.log(f"stopping training ({r})"))
    trainer = sft.make_trainer(model, tokenizer, enc.dataset, args, [callback])

    config = {
        "run_id": run_id, "job_id": ctx.job.id,
        "spec": {**spec.model_dump(mode="json"), "optim": optim},
        "requested_optim": spec.optim,
        "model": {"id": model_row.id, "name": model_row.name, "path": model_row.path,
                  "source": model_row.source, "info": model_row.info},
        "dataset": {"id": ds_row.id, "filename": ds_row.filename, "path": ds_row.path,
                    "format": ds_row.format, "rows_used": enc.rows, "tokens": enc.tokens,
                    "trained_tokens": enc.trained_tokens, "truncated_rows": enc.truncated},
        "chat_template": {"name": chosen.name, "template": chosen.source},
        "device": gpu.device_name(),
        "trainable_parameters": trainable,
        "training_arguments": {k: v for k, v in args.to_dict().items()
                               if isinstance(v, (int, float, str, bool, type(None)))},
        "versions": _versions(),
    }
    _atomic_write(run_dir / "config.json", json.dumps(config, indent=2, default=str))
    if not repo.list_artifacts(ctx.engine, run_id, kind="config"):
        _artifact(ctx, run_id, "config", run_dir / "config.json")

    # ---- train (resume from the newest checkpoint of an earlier attempt) ------------------
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(ckpt_dir)) if any(ckpt_dir.iterdir()) else None
    if last:
        ctx.log(f"resuming from {Path(last).name}")
    t0 = time.monotonic()
    out = trainer.train(resume_from_checkpoint=last)
    ctx.check()  # cancelled / shutdown (checkpoint already saved) / lease lost
    runtime = time.monotonic() - t0

    # ---- adapter ------------------------------------------------------------------------
    ctx.progress("save", 0, 1, "saving the adapter")
    adapter_dir = run_dir / "adapter"
    tmp = run_dir / f".adapter.tmp-{ctx.job.id}"
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    if chosen.source and not (tmp / "chat_template.jinja").exists():
        (tmp / "chat_template.jinja").write_text(chosen.source, encoding="utf-8")
    shutil.rmtree(adapter_dir, ignore_errors=True)
    tmp.rename(adapter_dir)
    zip_path = run_dir / "adapter.zip"
    _zip_folder(adapter_dir, zip_path)
    _artifact(ctx, run_id, "adapter", zip_path, folder=str(adapter_dir), format="peft")
    ctx.progress("save", 1, 1)

    losses = callback.losses
    state = trainer.state
    result = {
        "final_loss": losses[-1][1] if losses else None,
        "first_loss": losses[0][1] if losses else None,
        "train_loss": out.training_loss, "steps": state.global_step,
        "train_runtime": round(runtime, 3), "tokens": int(state.num_input_tokens_seen or 0),
        "trained_tokens_per_epoch": enc.trained_tokens, "rows": enc.rows,
        "adapter_dir": str(adapter_dir), "adapter_zip": str(zip_path),
        "chat_template": chosen.name,
    }
    ctx.log(f"done: {state.global_step} steps in {runtime:.1f}s, final loss "
            f"{result['final_loss']}")
    return result
