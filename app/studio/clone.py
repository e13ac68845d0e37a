"""Cloning a run into the new-run form: what a clone starts from (the run row's spec, which
is the one copy of it), for the SFT or the GRPO form as the run's kind says.

Resolved or derived fields are left out, so that the new run resolves them again from its own
choices: the chat template's name becomes the form's template choice, the dataset's column
mapping is taken from the dataset when the run is created.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine

from app.studio import access
from app.studio.datasets import deleted_name
from app.studio.runs import MAX_NAME_CHARS

if TYPE_CHECKING:
    from app.store.schema import User

#: Spec fields a clone does not copy: set when a run is created or by the worker.
DERIVED = ("spec_version", "chat_template_name", "column_mapping", "vram_budget_gib")


@dataclass(frozen=True)
class Clone:
    """A run's settings for a new run: ``kind`` (``sft`` | ``grpo``), the form that edits it
    (``form_url``), a ``name`` for the copy, the editable ``spec`` fields (TrainSpec or
    GrpoSpec names), ``template_choice``: the chat template the run used by name
    (``chatml``, ``model``, ... or ``custom`` for an edited one) and ``deleted``: for each of
    its inputs deleted since (left out of ``spec``, so the form asks for another), a sentence
    saying so."""

    run_id: str
    kind: str
    form_url: str
    name: str
    spec: dict[str, Any]
    template_choice: str | None
    deleted: tuple[str, ...] = ()


def clone_run(engine: Engine, actor: User, run_id: str) -> Clone:
    """The settings of run ``run_id`` for the new-run form.

    Raises:
        StudioError: not_found (unknown or another user's run).
    """
    run = access.run(engine, actor, run_id)
    spec = {k: v for k, v in (run.spec or {}).items() if k not in DERIVED}
    name = f"{run.name or run.id} (copy)"
    if len(name) > MAX_NAME_CHARS:
        name = name[:MAX_NAME_CHARS - 8].rstrip() + "… (copy)"
    kind = "grpo" if run.kind == "grpo" else "sft"
    deleted = []
    for field in ("dataset", "validation_file"):
        ds_id = spec.get(field)
        if ds_id and (gone := deleted_name(engine, ds_id)) is not None:
            spec.pop(field)
            deleted.append(f"The {field} {gone} that run {run.name or run.id} used was deleted: "
                           f"pick {'another' if field == 'dataset' else 'another, or none'}.")
    return Clone(run_id=run.id, kind=kind,
                 form_url=f"/runs/new/grpo?clone={run.id}" if kind == "grpo"
                 else f"/runs/new?clone={run.id}",
                 name=name, spec=spec,
                 template_choice=(run.spec or {}).get("chat_template_name"),
                 deleted=tuple(deleted))

