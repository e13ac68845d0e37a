"""``max_seq_length`` (SFT) and ``max_prompt_length`` + ``max_completion_length`` (GRPO): one
default and one bound for every way a run is created.

The run form, ``/api`` and ``/v1`` all start from :func:`app.studio.datasets.default_max_seq_length`
(TrainSpec's 1024 capped at the model's context window) when the caller names no length. A length
past the context window is refused (rows would train on positions the model never saw; Whetstone
does not scale RoPE), and so is a length too short to hold one minimal exchange in the run's chat
template with the model's own tokenizer (every row would be cut before its answer, and the worker
would find nothing to train on). A GRPO prompt and its completion share the window, so their
sum must fit it (:func:`fit_grpo_lengths`; a length the caller did not name shrinks to fit).
"""
from __future__ import annotations

from app.data.chat_template import render_chat
from app.data.errors import DatasetError
from app.data.template_check import SAMPLE_CHATS
from app.store.schema import Model
from app.store.specs import TrainSpec, field_bound
from app.studio.datasets import context_window, default_max_seq_length, ready_tokenizer_path
from app.studio.errors import StudioError, invalid
from app.studio.reports import load_bundle


def length_bounds() -> tuple[int, int]:
    """(least, most) tokens a ``max_seq_length`` may be: TrainSpec's field limits, the one
    definition the run forms, ``/api``, ``/v1`` and the dataset report share."""
    return (field_bound(TrainSpec, "max_seq_length", "ge"),
            field_bound(TrainSpec, "max_seq_length", "le"))


def report_length(raw: str | None, model: Model | None) -> int:
    """The ``max_seq_length`` a dataset's report counts against: ``raw`` as typed (empty:
    :func:`app.studio.datasets.default_max_seq_length` of ``model``).

    Raises StudioError invalid (field ``max_seq_length``) unless it is a whole number within
    :func:`length_bounds`."""
    if raw is None or not str(raw).strip():
        return default_max_seq_length(model)
    lo, hi = length_bounds()
    try:
        value = int(str(raw).strip())
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise invalid("max_seq_length", f"max_seq_length must be a whole number from {lo} to "
                                        f"{hi} tokens")
    return value


def template_tokens(model: Model, template: str | None) -> int | None:
    """Tokens that a one-question, one-answer chat takes in ``template`` with the model's
    tokenizer (None when the model is not ready or has no template to measure)."""
    folder = ready_tokenizer_path(model)
    if not folder or not template:
        return None
    try:
        bundle = load_bundle(folder)
        text = render_chat(SAMPLE_CHATS[1], template, bos_token=bundle.bos_token or "",
                           eos_token=bundle.eos_token or "")
    except (DatasetError, OSError, ValueError):
        return None
    return len(bundle.tokenizer.encode(text, add_special_tokens=False).ids)


def fit_max_seq_length(spec, model: Model):
    """``spec`` with ``max_seq_length`` defaulted to the model's (when the caller named none),
    after checking a given one against the model's context and the template's needs.

    ``spec.chat_template`` must already be resolved (the run's template source).

    Raises:
        StudioError: invalid (field ``max_seq_length``): longer than the model's context window,
            or too short for one exchange in the template.
    """
    if "max_seq_length" not in spec.model_fields_set:
        spec = spec.model_copy(update={"max_seq_length": default_max_seq_length(model)})
    n = spec.max_seq_length
    context = context_window(model)
    if context and n > context:
        raise invalid("max_seq_length", f"{n} is longer than {model.name}'s context window "
                      f"({context} tokens, max_position_embeddings); use {context} or less")
    need = template_tokens(model, spec.chat_template)
    if need is not None and n <= need:
        raise invalid("max_seq_length", f"{n} tokens cannot hold even a one-line question and "
                      f"answer in the {spec.chat_template_name or 'chosen'} template "
                      f"({need} tokens with {model.name}'s tokenizer), so every row would be cut "
                      f"before its answer; use at least {need + 1}, and more for real rows")
    return spec


GRPO_LENGTHS = {"max_prompt_length": "prompt length", "max_completion_length": "completion length"}


def grpo_length_problem(prompt: int, completion: int, context: int | None, model_name: str,
                        named: frozenset[str] | set[str] = frozenset()) -> StudioError | None:
    """Why a GRPO prompt of ``prompt`` tokens plus a completion of ``completion`` tokens cannot
    fit a ``context``-token window (None when they fit, or the window is unknown): an invalid
    StudioError on ``max_completion_length`` when the completion alone leaves no room for a
    prompt. Otherwise the message names both lengths and their sum; its field is the one length
    in ``named`` (the field the caller set) when only one is, else the longer of the two (the
    form sends both), and it says how far to lower that one, and the other when both are named
    and lowering it alone can fit."""
    if not context or prompt + completion <= context:
        return None
    window = f"{model_name}'s context window ({context} tokens, max_position_embeddings)"
    if completion >= context:
        verb = "is longer than" if completion > context else "fills"
        return invalid("max_completion_length", f"{completion} tokens {verb} {window}, which "
                       f"must hold a prompt and its completion together; use at most "
                       f"{context - 1}, and less to leave room for the prompt "
                       f"(max_prompt_length {prompt})")
    value = {"max_prompt_length": prompt, "max_completion_length": completion}
    mine = [f for f in GRPO_LENGTHS if f in named]
    field = mine[0] if len(mine) == 1 else max(GRPO_LENGTHS, key=lambda f: value[f])
    other = next(f for f in GRPO_LENGTHS if f != field)

    def lower(f: str) -> str:
        o = next(g for g in GRPO_LENGTHS if g != f)
        return f"{f} {context - value[o]} or less with this {GRPO_LENGTHS[o]}"
    advice = f"use {lower(field)}"
    if len(mine) != 1 and context - value[field] >= 1:
        advice = f"lower either ({lower(field)}, or {lower(other)})"
    return invalid(field, f"max_prompt_length {prompt} + max_completion_length {completion} = "
                   f"{prompt + completion} tokens is longer than {window}, which must hold a "
                   f"prompt and its completion together; {advice}")


def fit_grpo_lengths(spec, model: Model):
    """``spec`` (a GrpoSpec) with a ``max_prompt_length``/``max_completion_length`` the caller
    did not name shrunk so that their sum fits the model's context window (the named one is
    kept), after checking that the sum fits.

    Raises:
        StudioError: invalid (:func:`grpo_length_problem`: the field the caller named, or the
            longer one when both were): the sum is longer than the model's context window.
    """
    context = context_window(model)
    p, c = spec.max_prompt_length, spec.max_completion_length
    named = spec.model_fields_set
    if context and p + c > context:
        if "max_prompt_length" not in named and "max_completion_length" not in named:
            c = min(c, context // 2)
            p = min(p, context - c)
        elif "max_prompt_length" not in named and context - c >= 1:
            p = context - c
        elif "max_completion_length" not in named and context - p >= 1:
            c = context - p
        if (p, c) != (spec.max_prompt_length, spec.max_completion_length):
            spec = spec.model_copy(update={"max_prompt_length": p, "max_completion_length": c})
    problem = grpo_length_problem(p, c, context, model.name, named)
    if problem:
        raise problem
    return spec
