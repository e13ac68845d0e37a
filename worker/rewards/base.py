"""The reward interface, strict validation of what reward functions return, and advantages.

A reward function scores a :class:`Batch` (``n`` completions, grouped ``num_generations`` at a
time, with the dataset columns of each completion's prompt) and returns ``n`` numbers. Whatever
it returns goes through :func:`validate`, which stops the run — naming the function and the
offending sample — on an exception, ``None``, a non-number, NaN/inf or the wrong count. TRL
would turn ``None`` into NaN and silently drop the sample; we never let it get that far.

:func:`group_advantages` is the GRPO advantage: reward minus its group's mean, divided by the
group's (unbiased) standard deviation; a group whose rewards are all equal gets exactly zero.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Rewards whose group standard deviation is below this are treated as all equal.
ZERO_STD = 1e-6


class RewardError(RuntimeError):
    """A reward function failed; the message names it and quotes the offending sample."""

    def __init__(self, name: str, problem: str, sample: "Sample | None" = None):
        self.name, self.problem, self.sample = name, problem, sample
        text = f"reward function {name!r} {problem}"
        if sample is not None:
            text += f" — offending sample #{sample.index}: {sample.describe()}"
        super().__init__(text)


def _excerpt(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class Sample:
    """One completion and what its reward may look at."""

    index: int
    prompt: str
    completion: str
    completion_tokens: int
    item: dict[str, Any]

    def describe(self) -> str:
        return f"prompt {_excerpt(self.prompt)!r}, completion {_excerpt(self.completion)!r}"


@dataclass
class Batch:
    """``n`` completions; ``columns[c][i]`` is column ``c`` of completion ``i``'s dataset row."""

    prompts: list[str]
    completions: list[str]
    completion_tokens: list[int]
    columns: dict[str, list[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.completions)

    def sample(self, i: int) -> Sample:
        return Sample(i, self.prompts[i], self.completions[i], self.completion_tokens[i],
                      {c: v[i] for c, v in self.columns.items()})


class RewardFunction:
    """Base class: ``name`` (shown in charts and errors), ``weight``, and :meth:`score`."""

    name: str = "reward"
    weight: float = 1.0

    def score(self, batch: Batch) -> list[Any]:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        """Release resources (the sandbox process of a custom reward)."""


class PerSample(RewardFunction):
    """A reward computed one sample at a time by ``fn(sample) -> number``; an exception names
    the sample it happened on."""

    def __init__(self, name: str, fn: Callable[[Sample], Any], weight: float = 1.0):
        self.name, self.fn, self.weight = name, fn, weight

    def score(self, batch: Batch) -> list[Any]:
        out = []
        for i in range(len(batch)):
            s = batch.sample(i)
            try:
                out.append(self.fn(s))
            except Exception as exc:  # noqa: BLE001 - reported with the sample
                raise RewardError(self.name, f"raised {type(exc).__name__}: {exc}", s) from exc
        return out


def _as_number(value: Any) -> float | None:
    """A plain real number as float, else None (bool counts as 0/1; str, list, None do not)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    # numpy / torch scalars: a real number type with __float__ and no length
    if hasattr(value, "__float__") and not hasattr(value, "__len__") \
            and not isinstance(value, (str, bytes, complex)):
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    return None


def validate(name: str, values: Any, batch: Batch) -> list[float]:
    """Check a reward function's output for ``batch``; returns the floats or raises RewardError."""
    n = len(batch)
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sequence):
        kind = type(values).__name__
        raise RewardError(name, f"returned a {kind}, not a list of {n} numbers (one per completion)"
                          , batch.sample(0) if n else None)
    if len(values) != n:
        raise RewardError(name, f"returned {len(values)} rewards for {n} completions; it must "
                                f"return exactly one number per completion (no broadcasting)")
    out = []
    for i, v in enumerate(values):
        if v is None:
            raise RewardError(name, "returned None", batch.sample(i))
        f = _as_number(v)
        if f is None:
            kind = getattr(v, "type_name", None) or type(v).__name__
            raise RewardError(name, f"returned a {kind} ({_excerpt(repr(v), 60)}), not a number",
                              batch.sample(i))
        if math.isnan(f) or math.isinf(f):
            raise RewardError(name, f"returned {f}, not a finite number", batch.sample(i))
        out.append(f)
    return out


@dataclass
class Scores:
    """Validated rewards of one batch: per function, weighted total, advantages, group stats."""

    names: list[str]
    per_function: list[list[float]]  # [function][sample]
    total: list[float]
    advantages: list[float]
    zero_std_groups: int
    groups: int

    @property
    def frac_zero_std(self) -> float:
        return self.zero_std_groups / self.groups if self.groups else 0.0


def score_all(functions: Sequence[RewardFunction], batch: Batch, num_generations: int,
              scale: str = "group") -> Scores:
    """Run every reward function on ``batch``, validate, weight, and compute advantages."""
    per = [validate(f.name, f.score(batch), batch) for f in functions]
    total = [sum(f.weight * per[k][i] for k, f in enumerate(functions)) for i in range(len(batch))]
    adv, zero = group_advantages(total, num_generations, scale)
    return Scores([f.name for f in functions], per, total, adv, zero,
                  len(total) // num_generations)


def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def group_advantages(rewards: Sequence[float], num_generations: int,
                     scale: str = "group") -> tuple[list[float], int]:
    """GRPO advantages for rewards laid out group after group; returns (advantages, zero groups).

    ``scale``: ``group`` divides by each group's unbiased std, ``batch`` by the whole batch's,
    ``none`` keeps ``r - mean``. A group whose std is ~0 contributes exactly zero advantage (no
    division by a tiny number, no NaN). Raises ValueError when the count is not whole groups.
    """
    n = len(rewards)
    if num_generations < 1 or n % num_generations:
        raise ValueError(f"{n} rewards are not whole groups of {num_generations}")
    rs = [float(r) for r in rewards]
    if any(math.isnan(r) or math.isinf(r) for r in rs):
        raise ValueError("advantages need finite rewards")
    _, batch_std = _mean_std(rs)
    adv: list[float] = []
    zero = 0
    for g in range(0, n, num_generations):
        grp = rs[g:g + num_generations]
        m, s = _mean_std(grp)
        if s < ZERO_STD:
            zero += 1
            adv.extend(0.0 for _ in grp)
            continue
        d = {"group": s, "batch": batch_std, "none": 1.0}[scale]
        adv.extend((r - m) / d for r in grp)
    return adv, zero
