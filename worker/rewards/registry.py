"""Build a run's reward functions from its :class:`app.store.specs.GrpoSpec`."""
from __future__ import annotations

from worker.rewards.base import RewardFunction
from worker.rewards.builtin import make_builtin
from worker.rewards.sandbox import make_custom


def build(spec, answer_column: str | None) -> list[RewardFunction]:
    """One RewardFunction per ``spec.rewards`` entry; names are made unique (``format``,
    ``format_2``) so that charts and errors tell them apart."""
    out: list[RewardFunction] = []
    seen: dict[str, int] = {}
    for r in spec.rewards:
        base = r.label or r.name
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}_{seen[base]}"
        if r.name == "custom":
            out.append(make_custom(name, r.params, r.weight))
        else:
            out.append(make_builtin(r.name, r.params, answer_column, r.weight, name))
    return out
