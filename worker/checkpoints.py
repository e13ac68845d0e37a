"""Which trainer checkpoints are whole: a run resumes from the newest COMPLETE one.

The Hugging Face Trainer writes ``checkpoints/checkpoint-<step>/`` in place, file by file; a
worker killed or a disk filled in the middle leaves a folder that looks like a checkpoint but
cannot be loaded. :func:`is_complete` checks every file the trainer writes can be read to its
end (``trainer_state.json`` parses and names the step; each ``.safetensors`` file is as long as
its header says; each ``.pt``/``.pth`` file is a whole zip archive, torch's format), so no
marker file is needed. :func:`newest_complete` moves incomplete folders aside (to
``.incomplete-checkpoint-<step>``, which neither the rotation nor resume looks at).

A job's trainer does not rotate its own checkpoints: :func:`recorder` takes its
``save_total_limit`` over and :func:`rotate` applies it after each save, keeping besides the
newest ones every checkpoint a queued or running job of the run still names (a Playground
session, a checkpoint eval, an export; trial s24 M-3: a session opened on a checkpoint while the
run trained on failed when admitted, the trainer having removed it meanwhile).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

_STEP = re.compile(r"^checkpoint-(\d+)$")
#: Job kinds that train a run (they write its checkpoints; the others only read one).
TRAINING_KINDS = ("train", "grpo")
#: How a reading job is named in the run log.
READER_WORDS = {"playground": "Playground session", "evaluate": "checkpoint eval",
                "export": "export"}


def _safetensors_whole(path: Path) -> bool:
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return False
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return False
        try:
            meta = json.loads(fh.read(n))
        except ValueError:
            return False
    ends = [v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"]
    return size == 8 + n + max(ends, default=0)


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` (a ``checkpoint-<step>`` dir) holds a whole trainer checkpoint:
    ``trainer_state.json`` with ``global_step == <step>``, at least one weights file, and every
    weights/state file readable to its end. Never raises."""
    m = _STEP.match(folder.name)
    try:
        state = json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
        if not m or state.get("global_step") != int(m.group(1)):
            return False
        weights = list(folder.glob("*.safetensors")) + list(folder.glob("*.bin"))
        if not weights:
            return False
        for f in folder.iterdir():
            if f.suffix == ".safetensors" and not _safetensors_whole(f):
                return False
            if f.suffix in (".pt", ".pth", ".bin") and not zipfile.is_zipfile(f):
                return False
            if f.suffix == ".json":
                json.loads(f.read_text(encoding="utf-8"))
        return True
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def held_steps(engine, run_id: str) -> dict[int, Any]:
    """``{step: job}``: the checkpoints of run ``run_id`` that a queued or running job other
    than its training names in its payload's ``checkpoint_step`` (the oldest such job each)."""
    from app.store import repo

    held: dict[int, Any] = {}
    for job in repo.live_run_jobs(engine, run_id):
        step = (job.payload or {}).get("checkpoint_step")
        if job.kind not in TRAINING_KINDS and isinstance(step, int) \
                and not isinstance(step, bool):
            held.setdefault(step, job)
    return held


def rotate(engine, run_id: str, ckpt_dir: Path, keep: int,
           on_keep: Callable[[int, Any], None] | None = None,
           best: str | None = None) -> list[str]:
    """Apply ``save_total_limit = keep`` to the ``checkpoint-<step>`` folders of ``ckpt_dir``:
    remove all but the ``keep`` newest, except ``best`` (the trainer's best checkpoint folder,
    which ``load_best_model_at_end`` loads; the trainer's own rotation keeps it too) and those
    :func:`held_steps` names, which stay (each reported to ``on_keep(step, job)``) until a save
    after their job has ended. Returns the names of the folders removed. ``keep`` < 1 keeps
    every checkpoint."""
    if keep < 1 or not ckpt_dir.is_dir():
        return []
    found = sorted(((int(m.group(1)), p) for p in ckpt_dir.iterdir()
                    if p.is_dir() and (m := _STEP.match(p.name))), reverse=True)
    older = found[keep:]
    held = held_steps(engine, run_id) if older else {}
    removed = []
    for step, path in older:
        if best is not None and Path(best).name == path.name:
            continue
        if step in held:
            if on_keep is not None:
                on_keep(step, held[step])
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    return removed


def record(engine, run_id: str, job_id: int, step: int, folder: Path, model=None,
           keep: int | None = None, on_keep: Callable[[int, Any], None] | None = None,
           best: str | None = None) -> None:
    """Record a checkpoint the trainer just saved as an ``Artifact(kind="checkpoint")`` of the
    run (``meta.step``; ``path`` the folder), so a cancelled or failed run can be exported from
    its newest one. With ``model`` (the base's row) the folder's ``adapter_config.json`` names
    the base as others load it (:func:`worker.jobs.card.make_portable`), not a server path.
    With ``keep`` the run's checkpoints are then rotated (:func:`rotate`, ``on_keep`` and
    ``best`` its).

    The rows of the run's checkpoints whose folder is gone are deleted here: the run's
    listings show only checkpoints that can still be used."""
    from app.store import repo
    from app.store.schema import Artifact

    if model is not None and (folder / "adapter_config.json").is_file():
        from worker.jobs.card import make_portable

        make_portable(folder, model)
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    repo.add_artifact(engine, Artifact(run_id=run_id, job_id=job_id, kind="checkpoint",
                                       name=folder.name, path=str(folder), bytes=size,
                                       meta={"step": step}))
    if keep is not None:
        rotate(engine, run_id, folder.parent, keep, on_keep, best)
    gone = [a.id for a in repo.list_artifacts(engine, run_id, "checkpoint")
            if not Path(a.path).is_dir()]
    repo.delete_artifacts(engine, gone)


def recorder(ctx, run_id: str, model=None, args=None):
    """The TrainerCallback a training job adds so that every checkpoint it saves is recorded
    (:func:`record`) as an artifact of run ``run_id``. With ``args`` (the job's
    TrainingArguments) it also takes the trainer's rotation over: ``args.save_total_limit``
    becomes None (the trainer keeps every checkpoint) and each save is followed by
    :func:`rotate` with that limit, which says in the run log, once per checkpoint and job,
    when one is kept past it for a job that uses it. The callback's ``keep`` is that limit."""
    from worker.engine.callbacks import checkpoint_callback

    keep = None
    if args is not None and args.save_total_limit:
        keep, args.save_total_limit = int(args.save_total_limit), None
    told: set[tuple[int, int]] = set()

    def kept(step: int, job) -> None:
        if (step, job.id) not in told:
            told.add((step, job.id))
            what = READER_WORDS.get(job.kind, f"{job.kind} job")
            ctx.log(f"checkpoint-{step} is kept past save_total_limit={keep}: {what} {job.id} "
                    "uses it (it is removed at the first save after that job ends)")

    callback = checkpoint_callback(lambda step, folder, best: record(
        ctx.engine, run_id, ctx.job.id, step, folder, model, keep, kept, best))
    callback.keep = keep  # the limit it applies (None: the trainer's own), for the run's record
    return callback


def newest_complete(ckpt_dir: Path, on_skip: Callable[[str], None] | None = None) -> Path | None:
    """The complete ``checkpoint-<step>`` folder of ``ckpt_dir`` with the highest step, or None.

    Incomplete ones newer than it are renamed to ``.incomplete-checkpoint-<step>`` (replacing an
    older one of that name) and reported to ``on_skip`` with a one-line message.
    """
    if not ckpt_dir.is_dir():
        return None
    found = sorted(((int(m.group(1)), p) for p in ckpt_dir.iterdir()
                    if p.is_dir() and (m := _STEP.match(p.name))), reverse=True)
    for _, path in found:
        if is_complete(path):
            return path
        aside = path.with_name(f".incomplete-{path.name}")
        if aside.exists():
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        if on_skip is not None:
            on_skip(f"{path.name} is incomplete (its save was interrupted); set aside as "
                    f"{aside.name}")
    return None
