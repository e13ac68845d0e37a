"""The ``grpo`` job: GRPO (LoRA/QLoRA) of a registered model on a prompt dataset.

Payload: the fields of :class:`app.store.specs.GrpoSpec` plus ``run_id``. Writes under
``<data_dir>/runs/<run_id>/`` the same layout as the SFT ``train`` job (``config.json``,
``checkpoints/``, ``adapter/``, ``adapter.zip``), so export works on either.

Events: ``metric`` per logged step (``reward``, ``reward/<function>``, ``reward_std``, ``kl``,
``completion_length``, ``frac_zero_std_groups``, ``loss``, ...) and ``sample`` (``{"step",
"rows": [{"prompt", "completion", "tokens", "group", "rewards", "reward", "advantage"}]}``).

A reward function that fails (raises, returns None, a non-number, NaN, the wrong count, or
times out in its sandbox) fails the job with its name and the offending sample.

Result: ``{"steps", "first_reward", "final_reward", "train_runtime", "rows", "adapter_dir",
"adapter_zip", ...}``; with a held-out set also ``eval`` and ``reward_eval`` (the run's rewards
on greedy completions of held-out prompts, base vs fine-tuned: :mod:`worker.jobs.grpo_eval`).
"""
from __future__ import annotations

from typing import Any

from app.store.specs import GrpoSpec
from app.studio.seqlen import context_window, grpo_length_problem
from worker import ddp, gpu
from worker.context import JobContext, JobError
from worker.jobs import common
from worker.jobs.card import model_card
from worker import checkpoints
from worker.progress import rounded
from worker.rewards.base import RewardError


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def run(ctx: JobContext) -> dict[str, Any]:
    """Train a LoRA adapter with GRPO for the run in ``ctx.payload`` (see the module docstring)."""
    run_id, spec = common.job_spec(ctx, GrpoSpec, "grpo")
    if ddp.wants_launch(spec):  # num_gpus > 1: this process runs the ranks (worker/ddp.py)
        return ddp.launch(ctx, run_id, spec)
    main = ddp.is_main(ctx)  # a rank > 0 of a data-parallel run writes no record
    gpu.reset_peak()  # the result's memory_peak is this job's
    if spec.has_custom_rewards and not common.owner_may_run_custom_rewards(ctx):
        raise JobError("this run has a custom Python reward, and custom rewards are not allowed "
                       "for its owner (an admin allows them on the Admin page)")
    model_row, ds_row = common.job_inputs(ctx, spec)

    from app.data.encode import load_tokenizer_bundle
    from app.data.errors import DatasetError
    from worker.engine import data as edata
    from worker.engine import grpo, sft
    from worker.rewards.registry import build

    cuda = common.check_device(spec)
    run_dir, ckpt_dir = common.open_run_dir(ctx, run_id)
    ctx.log(f"GRPO on {gpu.device_name()}")

    # ---- prompts ----------------------------------------------------------------------------
    chosen = edata.choose_template(spec, model_row.chat_template)
    if chosen.note:
        ctx.log(chosen.note, "warning")
    try:
        bundle = load_tokenizer_bundle(model_row.path)
        prompts = grpo.build_prompts(ds_row.path, bundle, chosen.source, spec.prompt_column,
                                     spec.answer_column, spec.system_prompt, check=ctx.check)
    except (DatasetError, ValueError) as e:
        raise JobError(f"dataset {ds_row.filename}: {e}") from e
    ctx.log(f"{prompts.rows} prompts from column {prompts.prompt_column!r}"
            + (f", reference column {prompts.answer_column!r}" if prompts.answer_column else "")
            + (f"; {prompts.skipped} rows skipped (no prompt)" if prompts.skipped else "")
            + f"; reward columns: {', '.join(prompts.columns)}")
    from worker.jobs import grpo_eval

    held = grpo_eval.prepare(ctx, spec, prompts, bundle, chosen.source)
    ctx.check()

    # ---- model, LoRA, rewards, trainer ----------------------------------------------------
    problem = grpo_length_problem(spec.max_prompt_length, spec.max_completion_length,
                                  context_window(model_row), model_row.name)
    if problem:  # the model was not ready when the run was created
        raise JobError(f"{problem.field}: {problem.message}")
    model, optim = common.lora_model(ctx, spec, model_row, cuda)
    tokenizer = sft.load_tokenizer(model_row.path, chosen.source)
    functions = build(spec, prompts.answer_column)
    scorer = grpo.Scorer(functions, spec.num_generations, spec.scale_rewards)
    args = grpo.grpo_config(spec, str(ckpt_dir), cuda, optim)
    saved = checkpoints.recorder(ctx, run_id, model_row, args)  # rotates, keeping those in use
    trainable = common.log_lora(ctx, spec, model, "; rewards: " + ", ".join(
        f"{f.name}×{f.weight:g}" for f in functions))
    holder: dict[str, Any] = {}
    # reads the cancel flag at each step's end (a rank: the stop agreed after each step)
    callback = grpo.progress_callback(ctx.metric, ctx.reporter.sample, ctx.step_stop_reason,
                                      lambda: holder["trainer"],
                                      on_stop=lambda r: ctx.log(f"stopping training ({r})"),
                                      sample_every=spec.sample_every,
                                      warn=lambda m: ctx.log(m, "warning"))
    trainer = grpo.make_trainer(model, tokenizer, held.train, args, scorer,
                                spec.max_prompt_length,
                                [callback, *([saved] if main else [])],
                                on_log=ctx.log,
                                check=ctx.check)
    holder["trainer"] = trainer
    if spec.beta > 0:
        ctx.log(f"KL to the reference policy (beta={spec.beta:g}): the base model with the "
                f"adapter disabled" + ("" if trainer.ref_model is None else " (separate copy)"))

    if main:
        common.write_config(ctx, run_id, run_dir, {
            "run_id": run_id, "job_id": ctx.job.id, "kind": "grpo",
            "spec": {**spec.model_dump(mode="json"), "optim": optim},
            "requested_optim": spec.optim,
            "model": common.model_config_entry(model_row),
            "dataset": {"id": ds_row.id, "filename": ds_row.filename,
                        "rows_used": prompts.rows, "rows_skipped": prompts.skipped,
                        "prompt_column": prompts.prompt_column,
                        "answer_column": prompts.answer_column, "columns": prompts.columns},
            "chat_template": {"name": chosen.name, "template": chosen.source},
            "held_out": held.info,
            "prompt_example": prompts.examples[0] if prompts.examples else None,
            "rewards": [{"name": f.name, "weight": f.weight} for f in functions],
            "device": gpu.device_name(),
            "trainable_parameters": trainable,
            "training_arguments": common.training_arguments(args, saved),
        })

    # ---- train --------------------------------------------------------------------------------
    last = common.last_checkpoint(ctx, ckpt_dir)
    try:  # a stop inside a step (the rollout) saves the last completed one
        _, runtime = common.train(ctx, trainer, callback, last, single=ddp.world_size() == 1)
    except RewardError as e:
        raise JobError(f"stopped: {e}") from e
    finally:
        scorer.close()
    common.training_ended(ctx, callback, trainer.state)  # or a cancel that came too late
    if not main:
        return {}

    # ---- adapter ------------------------------------------------------------------------------
    rewards = [r for _, r in callback.rewards]
    k = max(1, min(5, len(rewards) // 4))
    card = model_card(model_row, run_id, common.run_name(ctx, run_id), "grpo",
                      spec.model_dump(mode="json"),
                      {"filename": ds_row.filename, "rows": prompts.rows}, chosen.name,
                      {"steps": trainer.state.global_step, "first_rewards_mean": _mean(rewards[:k]),
                       "last_rewards_mean": _mean(rewards[-k:])}, common.versions())
    adapter_dir, zip_path = common.save_adapter(ctx, run_id, run_dir, trainer, tokenizer,
                                                 chosen.source, model_row, card)

    result = {
        "steps": trainer.state.global_step, "train_runtime": round(runtime, 3),
        "first_reward": rewards[0] if rewards else None,
        "final_reward": rewards[-1] if rewards else None,
        "first_rewards_mean": _mean(rewards[:k]), "last_rewards_mean": _mean(rewards[-k:]),
        "rows": prompts.rows, "adapter_dir": str(adapter_dir), "adapter_zip": str(zip_path),
        "chat_template": chosen.name, "memory_peak": gpu.peak(),
    }
    result.update(grpo_eval.finish(ctx, run_id, run_dir, spec, held, trainer.model, tokenizer))
    ctx.log(f"done: {trainer.state.global_step} steps in {runtime:.1f}s, mean reward "
            f"{rounded(result['first_rewards_mean'])} -> {rounded(result['last_rewards_mean'])}")
    ctx.cancel_came_too_late(trainer.state.global_step, trainer.state.max_steps)  # one since
    return result
