"""The ``evaluate`` job: the generation eval of one trainer checkpoint of a run, on demand.

Payload: ``{"spec_version": 1, "run_id", "checkpoint_step", "samples"}`` (queued by
:func:`app.studio.checkpoint_eval.queue_eval`). The run's base model is loaded with the LoRA
adapter of ``checkpoints/checkpoint-<step>/`` and evaluated on the run's held-out set, chosen
exactly as training chose it (the same validation file, or the same seeded split), with the
table the end of the run makes:

* SFT: greedy answers of the base (adapter disabled) and the checkpoint beside the reference,
  exact match and token F1 (:func:`worker.engine.evaluation.generation_eval`);
* GRPO: the run's reward functions on greedy completions of the base and the checkpoint
  (:func:`worker.jobs.grpo_eval.evaluate`).

Result: ``{"checkpoint_step", "checkpoint", "samples", "held_out", "generation_eval" |
"reward_eval", "memory_peak"}``; the same JSON is written to
``runs/<run_id>/evals/checkpoint-<step>-job-<id>.json`` (artifact ``checkpoint_eval``, meta
``{"step", "eval_job_id"}``). A cancelled eval (checked before each held-out prompt) removes
that file and artifact, even when the cancel arrives as the job ends.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.store import repo
from app.store.specs import GrpoSpec, TrainSpec
from worker import gpu
from worker.context import JobContext, JobError
from worker.jobs import common


def checkpoint_folder(run, step: int) -> Path | None:
    """``checkpoints/checkpoint-<step>`` of the run when it holds a whole adapter, else None."""
    from worker.checkpoints import is_complete

    if not run.output_dir:
        return None
    folder = Path(run.output_dir) / "checkpoints" / f"checkpoint-{step}"
    ok = (folder / "adapter_config.json").is_file() and is_complete(folder)
    return folder if ok else None


def load_checkpoint(model_dir: str, folder: Path, load_in_4bit: bool, cuda: bool):
    """The base model (as training loaded it without the kernel engine: fp32 on the CPU,
    bf16/fp16 on CUDA, NF4 with ``load_in_4bit``) with the checkpoint's adapter, in eval mode.
    Raises JobError when either cannot be loaded."""
    from peft import PeftModel

    from worker.engine import sft

    try:
        base = sft.load_model(model_dir, load_in_4bit, cuda, engine=False)
        return PeftModel.from_pretrained(base, str(folder)).eval()
    except (OSError, ValueError, RuntimeError) as e:
        raise JobError(f"cannot load {folder.name}: {e}") from e


def _sft_held_out(ctx: JobContext, spec: TrainSpec, model_row, ds_row, template):
    from app.data.errors import DatasetError
    from worker.engine import data as edata
    from worker.jobs import evaluation

    try:
        enc = edata.build_dataset(ds_row.path, model_row.path, template, spec.max_seq_length,
                                  spec.train_on_responses_only, spec.dataset_format or None,
                                  check=ctx.check, column_mapping=spec.column_mapping)
    except DatasetError as e:
        raise JobError(f"dataset {ds_row.filename}: {e}") from e
    return evaluation.prepare(ctx, spec, enc, model_row, template)


def _grpo_held_out(ctx: JobContext, spec: GrpoSpec, model_row, ds_row, template):
    from app.data.encode import load_tokenizer_bundle
    from app.data.errors import DatasetError
    from worker.engine import grpo
    from worker.jobs import grpo_eval

    try:
        bundle = load_tokenizer_bundle(model_row.path)
        prompts = grpo.build_prompts(ds_row.path, bundle, template, spec.prompt_column,
                                     spec.answer_column, spec.system_prompt, check=ctx.check)
    except (DatasetError, ValueError) as e:
        raise JobError(f"dataset {ds_row.filename}: {e}") from e
    return grpo_eval.prepare(ctx, spec, prompts, bundle, template)


def run(ctx: JobContext) -> dict[str, Any]:
    """Evaluate the checkpoint named in ``ctx.payload`` (see the module docstring).
    Raises JobError: the run, its checkpoint or its held-out set is gone, custom rewards are
    no longer allowed for the owner, or a reward function fails."""
    from worker.engine import data as edata
    from worker.engine import sft
    from worker.jobs import grpo_eval
    from worker.jobs.common import add_artifact, atomic_write
    from worker.rewards.base import RewardError

    payload = ctx.payload
    step, samples = int(payload["checkpoint_step"]), int(payload["samples"])
    try:
        run_row = repo.get_run(ctx.engine, payload["run_id"])
    except repo.NotFound:
        raise JobError(f"run {payload['run_id']} no longer exists") from None
    grpo_run = run_row.kind == "grpo"
    spec = (GrpoSpec if grpo_run else TrainSpec).model_validate(run_row.spec)
    if not spec.has_held_out:
        raise JobError(f"run {run_row.id} has no held-out set to evaluate on")
    if grpo_run and spec.has_custom_rewards and not common.owner_may_run_custom_rewards(ctx):
        raise JobError("this run has a custom Python reward, and custom rewards are not allowed "
                       "for its owner (an admin allows them on the Admin page)")
    folder = checkpoint_folder(run_row, step)
    if folder is None:
        raise JobError(f"checkpoint-{step} of run {run_row.id} is no longer on disk (the "
                       "trainer keeps only its newest checkpoints)")
    path = Path(run_row.output_dir) / "evals" / f"{folder.name}-job-{ctx.job.id}.json"

    def undo() -> None:  # a cancelled eval keeps no table: no file, no artifact
        repo.delete_job_artifacts(ctx.engine, ctx.job.id)
        path.unlink(missing_ok=True)
        path.with_name(f".{path.name}.tmp").unlink(missing_ok=True)

    ctx.on_cancel(undo)
    gpu.reset_peak()
    model_row, ds_row = common.job_inputs(ctx, spec)
    cuda = common.check_device(spec)
    chosen = edata.choose_template(spec, model_row.chat_template)
    ctx.log(f"evaluating {folder.name} of run {run_row.id} on {gpu.device_name()}")
    held = (_grpo_held_out if grpo_run else _sft_held_out)(ctx, spec, model_row, ds_row,
                                                           chosen.source)
    ctx.check()
    model = load_checkpoint(model_row.path, folder, spec.load_in_4bit, cuda)
    tokenizer = sft.load_tokenizer(model_row.path, chosen.source)
    out: dict[str, Any] = {"checkpoint_step": step, "checkpoint": folder.name,
                           "samples": samples, "held_out": held.info}
    if grpo_run:
        try:
            out["reward_eval"] = grpo_eval.evaluate(
                ctx, spec.model_copy(update={"reward_eval_samples": samples}), held, model,
                tokenizer)
        except RewardError as e:
            raise JobError(f"stopped: {e}") from e
    else:
        from worker.jobs.evaluation import generation_table

        out["generation_eval"] = generation_table(ctx, model, tokenizer, held, samples,
                                                  folder.name)
    ctx.check()
    out["memory_peak"] = gpu.peak()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(out, indent=2))
    add_artifact(ctx, run_row.id, "checkpoint_eval", path, step=step, eval_job_id=ctx.job.id)
    return out
