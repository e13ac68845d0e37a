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
"rows", "adapter_dir", "adapter_zip", "memory_peak"}`` (``memory_peak``: :func:`worker.gpu.peak`).
"""
from __future__ import annotations

from typing import Any

from app.store.specs import TrainSpec
from worker import checkpoints, ddp, gpu
from worker.context import JobContext, JobError
from worker.jobs import added_tokens, common
from worker.jobs.card import model_card
from worker.progress import rounded


def run(ctx: JobContext) -> dict[str, Any]:
    """Train a LoRA adapter for the run in ``ctx.payload`` (see the module docstring)."""
    run_id, spec = common.job_spec(ctx, TrainSpec, "train")
    if ddp.wants_launch(spec):  # num_gpus > 1: this process runs the ranks (worker/ddp.py)
        return ddp.launch(ctx, run_id, spec)
    main = ddp.is_main(ctx)  # a rank > 0 of a data-parallel run writes no record
    gpu.reset_peak()  # the result's memory_peak is this job's
    model_row, ds_row = common.job_inputs(ctx, spec)

    from worker.engine import data as edata
    from worker.engine import sft

    cuda = common.check_device(spec)
    run_dir, ckpt_dir = common.open_run_dir(ctx, run_id)
    added_tokens.use_transformers(ctx, spec, cuda)  # add_template_tokens: not the kernel engine
    ctx.log(f"training on {gpu.device_name()}" + (
        " with the kernel engine (fused LoRA, Triton kernels)" if sft.use_engine(cuda) else ""))

    # ---- data (same encoding as the web preview) ----------------------------------------
    from app.data.model_config import seq_longer_than_context

    too_long = seq_longer_than_context(spec.max_seq_length, model_row.path, model_row.name)
    if too_long:
        ctx.log(too_long, "warning")
    chosen = edata.choose_template(spec, model_row.chat_template)
    if chosen.note:
        ctx.log(chosen.note, "warning")
    added = added_tokens.prepare(ctx, spec, model_row.path, chosen.source, run_dir, main)
    total = ds_row.rows or 0  # the valid rows validation counted; progress counts them too
    ctx.progress("tokenize", 0, total, "encoding the dataset")
    from app.data.errors import DatasetError

    try:
        enc = edata.build_dataset(ds_row.path, added.encode_dir, chosen.source, spec.max_seq_length,
                                  spec.train_on_responses_only, spec.dataset_format or None,
                                  check=ctx.check,
                                  progress=lambda n: ctx.progress("tokenize", n, max(total, n)),
                                  column_mapping=spec.column_mapping)
    except DatasetError as e:
        raise JobError(f"dataset {ds_row.filename}: {e}") from e
    ctx.progress("tokenize", *edata.tokenize_done(enc))
    dropped = edata.dropped_note(enc.dropped)
    if dropped:  # a summary; every row's reason as details (folded away on the run page)
        ctx.log(dropped[0], "warning", details=dropped[1])
    ctx.log(f"{enc.rows} training rows, {enc.tokens} tokens ({enc.trained_tokens} trained)"
            + (f", {enc.truncated} truncated to {spec.max_seq_length}" if enc.truncated else ""))
    from worker.engine.padding import batching_note

    note = batching_note(edata.row_lengths(enc.dataset), spec)
    if note:
        ctx.log(*note)
    from worker.engine.evaluation import eval_arguments, eval_callbacks
    from worker.jobs import evaluation

    held = evaluation.prepare(ctx, spec, enc, model_row, chosen.source, added.encode_dir)
    ctx.check()

    # ---- model, LoRA, trainer -----------------------------------------------------------
    model, optim = common.lora_model(ctx, spec, model_row, cuda, on_log=ctx.log, added=added)
    tokenizer = added.tokenizer  # saved with the adapter: it holds any added tokens
    # the engine checkpoints its own layers (budgeted, offloaded); HF's would run a second time
    args = sft.sft_config(spec, str(ckpt_dir), cuda, optim,
                          **({"gradient_checkpointing": False} if sft.use_engine(cuda) else {}),
                          **eval_arguments(spec, resuming=any(ckpt_dir.glob("checkpoint-*"))))
    trainable = common.log_lora(ctx, spec, model)
    # reads the cancel flag at each step's end (a rank: the stop agreed after each step)
    callback = sft.progress_callback(ctx.metric, ctx.step_stop_reason,
                                     on_stop=lambda r: ctx.log(f"stopping training ({r})"))
    reporter, eval_cbs = eval_callbacks(spec, ctx.metric) if held.eval_dataset is not None \
        else (None, [])
    saved = checkpoints.recorder(ctx, run_id, model_row, args)  # rotates, keeping those in use
    trainer = sft.make_trainer(model, tokenizer, held.train_dataset, args,
                               [callback, *([saved] if main else []), *eval_cbs],
                               eval_dataset=held.eval_dataset)

    if main:
        common.write_config(ctx, run_id, run_dir, {
            "run_id": run_id, "job_id": ctx.job.id,
            "spec": {**spec.model_dump(mode="json"), "optim": optim},
            "requested_optim": spec.optim,
            "model": common.model_config_entry(model_row),
            "dataset": {"id": ds_row.id, "filename": ds_row.filename,
                        "format": ds_row.format, "rows_used": enc.rows, "tokens": enc.tokens,
                        "trained_tokens": enc.trained_tokens, "truncated_rows": enc.truncated},
            "held_out": held.info,
            "chat_template": {"name": chosen.name, "template": chosen.source},
            "device": gpu.device_name(),
            "trainable_parameters": trainable,
            "training_arguments": common.training_arguments(args, saved),
        })

    # ---- train (resume from the newest checkpoint of an earlier attempt) ------------------
    last = common.last_checkpoint(ctx, ckpt_dir)
    out, runtime = common.train(ctx, trainer, callback, last, single=ddp.world_size() == 1)
    # cancelled / shutdown (checkpoint already saved) / lease lost; or a cancel too late
    common.training_ended(ctx, callback, trainer.state)
    if not main:
        return {}

    # ---- adapter ------------------------------------------------------------------------
    losses, train_loss = common.with_earlier_losses(ctx, callback.start_step, callback.losses,
                                                    out.training_loss, trainer.state.global_step)
    card = model_card(model_row, run_id, common.run_name(ctx, run_id), "sft",
                      spec.model_dump(mode="json"),
                      {"filename": ds_row.filename, "rows": enc.rows, "format": ds_row.format},
                      chosen.name, {"steps": trainer.state.global_step,
                                    "first_loss": losses[0][1] if losses else None,
                                    "final_loss": losses[-1][1] if losses else None,
                                    "train_loss": train_loss},
                      common.versions())
    adapter_dir, zip_path = common.save_adapter(ctx, run_id, run_dir, trainer, tokenizer,
                                                 chosen.source, model_row, card)

    state = trainer.state
    result = {
        "final_loss": losses[-1][1] if losses else None,
        "first_loss": losses[0][1] if losses else None,
        "train_loss": train_loss, "steps": state.global_step,
        "train_runtime": round(runtime, 3), "tokens": int(state.num_input_tokens_seen or 0),
        "trained_tokens_per_epoch": enc.trained_tokens, "rows": enc.rows,
        "adapter_dir": str(adapter_dir), "adapter_zip": str(zip_path),
        "chat_template": chosen.name, "memory_peak": gpu.peak(),
    }
    result.update(evaluation.finish(ctx, run_id, run_dir, spec, held, reporter, trainer,
                                    tokenizer, callback.start_step))
    ctx.log(f"done: {state.global_step} steps in {runtime:.1f}s, final loss "
            f"{rounded(result['final_loss'])}")
    ctx.cancel_came_too_late(state.global_step, state.max_steps)  # one asked for since: told
    return result
