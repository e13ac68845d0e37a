"""Built-in rewards: numeric answer match, exact / regex match against a column, format, length.

Each is a :class:`~worker.rewards.base.PerSample` reward built from a
:class:`app.store.specs.RewardSpec`; ``answer_column`` is the run's reference column, the default
``column`` of the match rewards.
"""
from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from app.data.answers import extract_answer, reference_answer
from worker.rewards.base import PerSample, Sample

def _column(sample: Sample, column: str | None, reward: str) -> Any:
    if not column:
        raise KeyError(f"{reward} needs a reference column; set the run's answer column or "
                       f"params.column")
    if column not in sample.item:
        raise KeyError(f"the dataset row has no column {column!r} (it has: "
                       f"{', '.join(sorted(sample.item)) or 'none'})")
    return sample.item[column]


def numeric_match(params: dict, answer_column: str | None):
    column = params.get("column") or answer_column
    strict = bool(params.get("strict", False))

    def fn(s: Sample) -> float:
        ref = reference_answer(_column(s, column, "numeric_match"))
        if ref is None:
            raise ValueError(f"the reference in column {column!r} has no number")
        got = extract_answer(s.completion, strict)
        return 1.0 if got is not None and abs(got - ref) <= Decimal("1e-6") else 0.0

    return fn


def exact_match(params: dict, answer_column: str | None):
    column = params.get("column") or answer_column
    case = bool(params.get("case_sensitive", False))
    strip = bool(params.get("strip", True))

    def norm(x: Any) -> str:
        x = str(x)
        x = " ".join(x.split()) if strip else x
        return x if case else x.casefold()

    contains = bool(params.get("contains", False))
    negate = bool(params.get("negate", False))

    def fn(s: Sample) -> float:
        got, ref = norm(s.completion), norm(_column(s, column, "exact_match"))
        hit = ref in got if contains else got == ref
        return 1.0 if hit != negate else 0.0

    return fn


def text_similarity(params: dict, answer_column: str | None):
    """``fuzzy_match``: difflib's ratio of the completion to the column, in [0, 1]; with
    ``pass_threshold`` the reward is 1 at or above it, else 0."""
    import difflib

    column = params.get("column") or answer_column
    threshold = params.get("pass_threshold")

    def fn(s: Sample) -> float:
        ref = str(_column(s, column, "text_similarity")).strip()
        ratio = difflib.SequenceMatcher(None, s.completion.strip(), ref).ratio()
        if threshold is None:
            return ratio
        return 1.0 if ratio >= float(threshold) else 0.0

    return fn


#: Seconds one ``regex_match`` search may take on one completion: a pattern that backtracks
#: without bound (nested quantifiers such as ``(\w+\s*)*``) would otherwise hold the training
#: process in C code for hours, its heartbeat and its cancel with it (trial s22, F12).
REGEX_TIMEOUT_SECONDS = 1.0


def regex_match(params: dict, answer_column: str | None):
    """1 when ``params.pattern`` matches the completion (with ``params.column``: its first
    group, else the whole match, equals that column's value), matched by the ``regex`` library
    with :data:`REGEX_TIMEOUT_SECONDS` a search.

    Raises (from the reward): ValueError naming the pattern when a search runs out of time."""
    import regex

    pattern = regex.compile(params["pattern"], regex.DOTALL if params.get("dotall") else 0)
    column = params.get("column")

    def fn(s: Sample) -> float:
        try:
            m = pattern.search(s.completion, timeout=REGEX_TIMEOUT_SECONDS)
        except TimeoutError:
            raise ValueError(
                f"the pattern {params['pattern']!r} took more than {REGEX_TIMEOUT_SECONDS:g} s "
                f"on one completion of {len(s.completion):,} characters: it backtracks without "
                "bound (nested repeats such as (\\w+\\s*)*); simplify it") from None
        if column is None:
            return 1.0 if m else 0.0
        if not m:
            return 0.0
        got = m.group(1) if pattern.groups else m.group(0)
        return 1.0 if (got or "").strip() == str(_column(s, column, "regex_match")).strip() \
            else 0.0

    return fn


def format_reward(params: dict, answer_column: str | None):
    r = re.escape(params.get("reasoning_tag", "think"))
    a = re.escape(params.get("answer_tag", "answer"))
    full = re.compile(rf"^\s*<{r}>.+?</{r}>\s*<{a}>.+?</{a}>\s*$", re.DOTALL)
    loose = re.compile(rf"<{r}>.*?</{r}>.*?<{a}>.*?</{a}>", re.DOTALL)

    def fn(s: Sample) -> float:
        if full.match(s.completion):
            return 1.0
        return 0.5 if loose.search(s.completion) else 0.0

    return fn


def length_penalty(params: dict, answer_column: str | None):
    target = int(params["target_tokens"])

    def fn(s: Sample) -> float:
        over = max(0, s.completion_tokens - target)
        return -min(1.0, over / target)

    return fn


BUILTINS = {"numeric_match": numeric_match, "exact_match": exact_match,
            "regex_match": regex_match, "format": format_reward, "length_penalty": length_penalty,
            "text_similarity": text_similarity}

def make_builtin(name: str, params: dict, answer_column: str | None, weight: float = 1.0,
                 label: str | None = None) -> PerSample:
    """A built-in reward by name (KeyError for an unknown one)."""
    return PerSample(label or name, BUILTINS[name](params, answer_column), weight)
