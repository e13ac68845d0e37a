"""File helpers shared by every exporter: atomic writes, sha256, the ``files`` result list.

Every export writes into a temporary sibling (``<name>.partial-<pid>``) and renames it into
place with :func:`os.replace`, so a crashed or retried job never leaves a half-written file
under the final name (the job is idempotent: a retry overwrites the same names).
"""
from __future__ import annotations

import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

#: ``progress(stage, fraction)``: ``stage`` is a short label, ``fraction`` in [0, 1].
ProgressFn = Callable[[str, float], None]

CHUNK = 1 << 20  # bytes per read while hashing/uploading (1 MiB)


class ExportError(RuntimeError):
    """An export could not be produced; the message says what the user can do about it."""


def noop_progress(stage: str, fraction: float) -> None:  # noqa: D401 - a callback
    """Progress callback that ignores updates."""


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


@contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``final``; on success rename it to ``final``.

    Works for files and directories. On an exception the temporary is removed and the
    previous ``final`` (if any) is left untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.partial-{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
        if final.is_dir() and tmp.is_dir():
            old = final.with_name(f"{final.name}.old-{os.getpid()}")
            _remove(old)
            os.replace(final, old)
            os.replace(tmp, final)
            _remove(old)
        else:
            os.replace(tmp, final)
    except BaseException:
        _remove(tmp)
        raise


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def describe_files(paths: list[Path], root: Path) -> list[dict]:
    """``[{"name", "path", "size", "sha256"}]`` for files (directories are walked, sorted).

    ``name`` is relative to ``root`` (POSIX separators); ``size`` is in bytes.
    """
    out: list[dict] = []
    for p in paths:
        items = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
        for q in items:
            out.append({"name": q.relative_to(root).as_posix(), "path": str(q),
                        "size": q.stat().st_size, "sha256": sha256_file(q)})
    return out
