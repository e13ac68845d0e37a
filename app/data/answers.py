"""The number a GSM8K-style answer holds, one rule for the ``numeric_match`` reward (worker) and
for the checks made before a run starts (a prompt dataset's report says which columns hold a
number in every row; the GRPO form pre-selects ``numeric_match`` only for those). Pure Python.

Sources: GSM8K's ``#### n`` answers (Cobbe et al. 2021), ``\\boxed{}`` of the MATH dataset
(Hendrycks et al. 2021), ``<answer>`` tags of the R1-style format prompts.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

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


class NumberCount:
    """Which columns of a dataset hold a reference number (:func:`reference_answer`) in every
    row: :meth:`add` each row, then :meth:`report`. Cells that are not text or numbers (a list
    of messages) are not counted; columns in ``skip`` (the prompt) neither."""

    #: Characters of a cell kept as the example of a row without a number.
    EXAMPLE_CHARS = 80

    def __init__(self, skip: set[str] | None = None):
        self.skip = skip or set()
        self.cols: dict[str, dict[str, Any]] = {}

    def add(self, row: int, data: dict[str, Any]) -> None:
        """Count row number ``row`` (1-based) of the dataset, its cells in ``data``."""
        for col, value in data.items():
            if col in self.skip or isinstance(value, bool) \
                    or not isinstance(value, (str, int, float)):
                continue
            c = self.cols.setdefault(col, {"rows": 0, "with_number": 0, "first_without": None,
                                           "example": None})
            c["rows"] += 1
            if reference_answer(value) is not None:
                c["with_number"] += 1
            elif c["first_without"] is None:
                c["first_without"] = row
                c["example"] = str(value)[:self.EXAMPLE_CHARS]

    def report(self) -> dict[str, dict[str, Any]]:
        """``{column: {"rows", "with_number", "first_without" (row or None), "example"}}``."""
        return {k: dict(v) for k, v in sorted(self.cols.items())}
