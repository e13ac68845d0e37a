"""A run's trainer checkpoints as downloads: one zip per ``checkpoint-<step>`` folder, built while
it is sent (no file is written), owner-only.

The plain download holds what loads the checkpoint elsewhere: the adapter
(``adapter_model.safetensors``, ``adapter_config.json``), the tokenizer files and chat template
when the trainer saved them, the model card. The trainer's own state (``optimizer.pt``,
``scheduler.pt``, ``rng_state*.pth``, ``trainer_state.json``), needed only
to continue training, comes with ``state=True``. Entries are named ``checkpoint-<step>/<file>``:
never a server path, and the text files (``TEXT_SUFFIXES``: the model card PEFT writes with
``base_model: <folder>``, the configs) are sent with every path under the data dir or the base's
folder replaced by the base's public id (:func:`app.studio.artifacts.portable_text`), as the
worker rewrites them too. ``training_args.bin`` (the pickled ``TrainingArguments``, which hold
the run's server paths: ``output_dir``, ``logging_dir``) is never sent: the trainer only writes
it, resuming (``resume_from_checkpoint``) reads the optimizer, scheduler, RNG and
``trainer_state.json``, not it.
"""
from __future__ import annotations

import fnmatch
import io
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from sqlalchemy.engine import Engine

from app.settings import Settings
from app.store import repo
from app.store.schema import Artifact, User
from app.studio import access, audit
from app.studio.artifacts import base_model_id, checkpoint_step, portable_text
from app.studio.datasets import is_under
from app.studio.errors import StudioError, whole
from app.studio.exports import download_name

#: File names (glob) of the trainer's resume state, left out of the plain download.
STATE_FILES = ("optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt", "rng_state*.pth",
               "trainer_state.json", "global_step*", "latest")
#: Files never sent: the trainer's pickled arguments name server paths; resuming does not read them.
NEVER_SENT = ("training_args.bin",)
CHUNK = 1024 * 1024
#: Suffixes of the text files whose server paths are rewritten in a download.
TEXT_SUFFIXES = (".json", ".md", ".txt", ".jinja", ".yaml", ".yml")
#: Larger text files (a big ``tokenizer.json``) are sent as saved: they name no folders.
TEXT_LIMIT = 64 * 1024 * 1024


def is_state(relpath: str) -> bool:
    """Whether ``relpath`` (inside a checkpoint folder) is trainer resume state."""
    top = relpath.split("/", 1)[0]
    return any(fnmatch.fnmatch(top, pat) for pat in STATE_FILES)


def step_of(value: str) -> int:
    """``value`` (the ``{step}`` of a checkpoint URL) as a step number. Raises StudioError
    invalid (field ``step``) unless it is a whole number >= 0."""
    text = str(value).strip()
    step = whole(text) if text[:1].isdigit() else None  # no sign: "+5" and "-1" are no step
    if step is None:
        shown = repr(value) if len(str(value)) <= 40 else repr(str(value)[:40] + "…")
        raise StudioError("invalid", f"step {shown} is not a checkpoint step: use a whole "
                          "number >= 0, as the run page lists (checkpoint-<step>)", field="step")
    return step


def _folder(engine: Engine, settings: Settings, run_id: str, step: int) -> Artifact:
    for art in repo.list_artifacts(engine, run_id, "checkpoint"):
        if (art.meta or {}).get("step") == step:
            if checkpoint_step(art) == step and is_under(art.path, settings.data_dir):
                return art
            break
    from app.studio.checkpoint_eval import checkpoint_steps, missing_words

    raise StudioError("not_found", missing_words(engine, run_id, step,
                                                 checkpoint_steps(engine, run_id)))


def files(folder: str | Path, state: bool = False) -> list[tuple[Path, str]]:
    """``[(file, relative name)]`` of a checkpoint folder, sorted: regular files only (links
    are skipped), the trainer's state only with ``state``, never ``NEVER_SENT``."""
    root = Path(folder)
    out = []
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not os.path.islink(os.path.join(dirpath, d)))
        for name in sorted(names):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink() or not path.is_file() or rel in NEVER_SENT or \
                    (not state and is_state(rel)):
                continue
            out.append((path, rel))
    return out


def listing(engine: Engine, run_id: str) -> list[dict[str, Any]]:
    """The run's checkpoints on disk for its page, newest first: ``step``, ``name``,
    ``bytes`` (the plain download's files), ``state_bytes`` (with the trainer state), ``url``
    and ``state_url`` (the page downloads)."""
    rows = []
    for art in reversed(repo.list_artifacts(engine, run_id, "checkpoint")):
        step = checkpoint_step(art)
        if step is None:
            continue
        sizes = [(p.stat().st_size, is_state(rel)) for p, rel in files(art.path, state=True)]
        url = f"/runs/{run_id}/checkpoints/{step}/download"
        rows.append({"step": step, "name": f"checkpoint-{step}",
                     "bytes": sum(n for n, st in sizes if not st),
                     "state_bytes": sum(n for n, _ in sizes), "url": url,
                     "state_url": f"{url}?state=true"})
    return sorted(rows, key=lambda r: -r["step"])


class _Sink:
    """A write-only, unseekable file that keeps what is written until :meth:`take`."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


def _stream(opened: list[tuple[IO[bytes], zipfile.ZipInfo]]) -> Iterator[bytes]:
    sink = _Sink()
    try:
        with zipfile.ZipFile(sink, "w", zipfile.ZIP_STORED) as z:  # type: ignore[arg-type]
            for fh, info in opened:
                with z.open(info, "w", force_zip64=info.file_size > 2**31) as dst:
                    while chunk := fh.read(CHUNK):
                        dst.write(chunk)
                        if data := sink.take():
                            yield data
        if data := sink.take():
            yield data
    finally:
        for fh, _ in opened:
            fh.close()


def archive(engine: Engine, settings: Settings, actor: User, run_id: str, step: int | str,
            state: bool = False) -> tuple[str, Iterator[bytes]]:
    """``(download name, zip bytes)`` of checkpoint ``step`` of the run: the zip is produced
    chunk by chunk as the iterator is read (stored, not compressed: safetensors weights do not
    shrink), from files opened here, so a checkpoint the trainer rotates away meanwhile is still
    sent whole. The download is named like the run's other files
    (``my-run-checkpoint-40.zip``; ``…-checkpoint-40-with-state.zip`` with ``state``).

    Raises:
        StudioError: not_found when the run is unknown or another user's, or the checkpoint is
            not (or no longer) on disk; invalid (field ``step``) for a step that is not a whole
            number >= 0 (:func:`step_of`).
    """
    run = access.run(engine, actor, run_id)
    step = step_of(str(step))
    art = _folder(engine, settings, run_id, step)
    model = repo.get_model(engine, run.model_id)
    roots = [str(settings.data_dir), os.path.realpath(settings.data_dir), model.path or "",
             *model.source_ref.split("|")]
    opened: list[tuple[IO[bytes], zipfile.ZipInfo]] = []
    try:
        for path, rel in files(art.path, state):
            fh: IO[bytes] = open(path, "rb")
            info = zipfile.ZipInfo.from_file(path, f"checkpoint-{step}/{rel}")
            if path.suffix in TEXT_SUFFIXES and info.file_size <= TEXT_LIMIT:
                with fh:
                    data = portable_text(fh.read().decode("utf-8", "surrogateescape"), roots,
                                         base_model_id(model)).encode("utf-8", "surrogateescape")
                fh, info.file_size = io.BytesIO(data), len(data)
            opened.append((fh, info))
    except OSError:
        for fh, _ in opened:
            fh.close()
        raise StudioError("not_found", f"checkpoint-{step} of run {run_id} was removed while "
                          "it was being read (the trainer rotated it away)") from None
    if not opened:
        raise StudioError("not_found", f"checkpoint-{step} of run {run_id} holds no files")
    audit.record(engine, actor.id, "checkpoint.downloaded", "run", run_id, step=step,
                 state=state)
    suffix = "-with-state" if state else ""
    return download_name(engine, run_id, f"{run_id}-checkpoint-{step}{suffix}.zip"), \
        _stream(opened)
