"""A run's ``add_template_tokens``: the chat template's special tokens the base lacks, added to
the tokenizer before the dataset is encoded and to the model before LoRA.

:func:`prepare` (before encoding) extends the run's tokenizer (:mod:`worker.engine.new_tokens`),
logs which tokens it added and saves it to ``<run>/tokenizer/`` (the dataset and a held-out set
are encoded with it, so a marker is one token); :func:`grow` (after the model loads) appends the
embedding rows. The ids go to ``LoraConfig(trainable_token_indices=...)``
(:func:`worker.engine.sft.add_lora`); the tokenizer is saved with the adapter, so exports carry
the new vocabulary. The kernel engine does not train added rows: such a run trains with
transformers + PEFT on the GPU (:func:`use_transformers`).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from worker.context import JobContext


@dataclass
class AddedTokens:
    """The run's tokenizer and where its files are (``encode_dir``: the model's folder when
    nothing was added); ``tokens``/``ids``: what was added (empty: nothing)."""

    tokenizer: object
    encode_dir: str
    tokens: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)


def use_transformers(ctx: JobContext, spec, cuda: bool) -> None:
    """On a GPU worker, make this job (its own child process) train with transformers + PEFT
    instead of the kernel engine when ``spec.add_template_tokens`` is set (logged)."""
    from worker.engine import sft

    if getattr(spec, "add_template_tokens", False) and sft.use_engine(cuda):
        os.environ["WHETSTONE_ENGINE"] = "0"
        ctx.log("add_template_tokens: the kernel engine does not train added token rows; this "
                "run trains with transformers + PEFT (trainable_token_indices)", "warning")


def prepare(ctx: JobContext, spec, model_dir: str, template: str | None, run_dir: Path,
            main: bool = True) -> AddedTokens:
    """The run's tokenizer (:func:`worker.engine.sft.load_tokenizer`), extended with the
    template's missing markers when ``spec.add_template_tokens`` (see the module docstring).
    Written to ``run_dir/tokenizer`` through a temp folder (a rank > 0 of a data-parallel run:
    a temp folder of its own)."""
    from worker.engine import sft
    from worker.engine.new_tokens import extend_tokenizer, missing_template_tokens

    tok = sft.load_tokenizer(model_dir, template)
    if not getattr(spec, "add_template_tokens", False):
        return AddedTokens(tok, model_dir)
    if not template:
        ctx.log("add_template_tokens: the run has no chat template; no token added", "warning")
        return AddedTokens(tok, model_dir)
    missing = missing_template_tokens(tok, template)
    ids = extend_tokenizer(tok, missing)
    if not ids:
        ctx.log("add_template_tokens: the tokenizer has every special token of the chat "
                "template; none added")
        return AddedTokens(tok, model_dir)
    ctx.log(f"add_template_tokens: added {len(ids)} special tokens to the tokenizer: "
            + ", ".join(f"{t} (id {i})" for t, i in zip(missing, ids))
            + f"; vocabulary {len(tok)}; their embedding rows train beside LoRA "
            "(trainable_token_indices)")
    if main:
        tmp = Path(tempfile.mkdtemp(prefix=".tokenizer.tmp-", dir=run_dir))
        tok.save_pretrained(str(tmp))
        final = run_dir / "tokenizer"
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    else:
        final = Path(tempfile.mkdtemp(prefix="whetstone-tokenizer-"))
        tok.save_pretrained(str(final))
    return AddedTokens(tok, str(final), missing, ids)


def grow(model, added: AddedTokens) -> None:
    """Append the added tokens' embedding rows (mean-initialised) to ``model``; no-op when
    nothing was added."""
    from worker.engine.new_tokens import grow_embeddings

    if added.ids:
        grow_embeddings(model, len(added.tokenizer))
