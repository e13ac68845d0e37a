"""Built-in rewards: numeric answer match, exact / regex match against a column, format, length.

Each is a :class:`~worker.rewards.base.PerSample` reward built from a
:class:`app.store.specs.RewardSpec`; ``answer_column`` is the run's reference column, the default
``column`` of the match rewards.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from worker.rewards.base import PerSample, Sample

_NUMBER = r"-?\$?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*(" + _NUMBER + r")")
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def _boxed(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}`` in ``text`` (nested braces balanced)."""
    out = []
    start = 0
    while True:
        i = text.find("\\boxed{", start)
        if i < 0:
            return out
        j = i + len("\\boxed{")
        depth = 1
        k = j
        while k < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            k += 1
        if depth == 0:
            out.append(text[j:k - 1])
        start = k


def to_number(text: str) -> Decimal | None:
    """``"1,234"``, ``"$5"``, ``"3.50"``, ``"7/2"``, ``"\\frac{7}{2}"`` -> Decimal; else None."""
    t = str(text).strip()
    frac = re.fullmatch(r"\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", t)
    if frac:
        t = f"{frac.group(1)}/{frac.group(2)}"
    t = re.sub(r"^\\text\{(.*)\}$", r"\1", t)
    t = t.replace(",", "").replace("$", "").replace(" ", "").rstrip(".").rstrip("%")
    try:
        if "/" in t:
            a, b = t.split("/", 1)
            den = Decimal(b)
            return Decimal(a) / den if den != 0 else None
        return Decimal(t)
    except (InvalidOperation, ValueError):
        return None


def extract_answer(text: str, strict: bool = False) -> Decimal | None:
    """The final numeric answer in ``text``.

    Looks, in order, at the last ``\\boxed{}``, the last ``#### n`` (GSM8K), the last
    ``<answer>...</answer>``; unless ``strict``, then the last number anywhere.
    """
    text = str(text)
    for box in reversed(_boxed(text)):
        n = to_number(box)
        if n is not None:
            return n
    hashes = _HASHES_RE.findall(text)
    if hashes:
        return to_number(hashes[-1])
    for tag in reversed(_ANSWER_TAG_RE.findall(text)):
        n = to_number(tag)
        if n is None:
            nums = _NUMBER_RE.findall(tag)
            n = to_number(nums[-1]) if nums else None
        if n is not None:
            return n
    if strict:
        return None
    nums = _NUMBER_RE.findall(text)
    return to_number(nums[-1]) if nums else None


def reference_answer(value: Any) -> Decimal | None:
    """The reference number of a dataset cell: GSM8K ``... #### 72``, ``\\boxed{}``, or a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    return extract_answer(str(value), strict=False)


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


def regex_match(params: dict, answer_column: str | None):
    pattern = re.compile(params["pattern"], re.DOTALL if params.get("dotall") else 0)
    column = params.get("column")

    def fn(s: Sample) -> float:
        m = pattern.search(s.completion)
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
