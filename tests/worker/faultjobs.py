"""Job handlers for the fault tests, run by real worker processes (see fault_worker.py).

* ``tick``: for ``seconds`` seconds append the time to ``<data_dir>/ticks/<job>-<attempt>``
  every 20 ms, calling ``ctx.check()`` only every ``step`` seconds (a long training step);
* ``fill``: write ``<data_dir>/fill/<job>`` in 64 KiB chunks until the disk is full (or, with
  ``inject``, raise ENOSPC at once, as a full disk does);
* ``hog``: hold ``mib`` MiB of touched memory, then tick like ``tick``;
* ``wedge``: hold the interpreter in a backtracking regular expression (no heartbeat);
* ``oom``: tick for ``seconds``, then raise torch's ``OutOfMemoryError`` as a CUDA allocation
  past the memory left does (the admission tests' injected out-of-memory failure).
"""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path


def _ticks(ctx, seconds: float, step: float) -> dict:
    out = Path(ctx.settings.data_dir) / "ticks"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{ctx.job.id}-{ctx.job.attempts}"
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        step_end = min(time.monotonic() + step, end)
        while time.monotonic() < step_end:
            with path.open("a") as fh:
                fh.write(f"{time.time():.3f}\n")
            time.sleep(0.02)
        ctx.check()
    return {"by": ctx.worker_id}


def tick(ctx) -> dict:
    p = ctx.payload
    out = _ticks(ctx, float(p.get("seconds", 1.0)), float(p.get("step", 0.05)))
    return {**out, "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR")}


def fill(ctx) -> dict:
    if ctx.payload.get("inject"):
        raise OSError(errno.ENOSPC, "No space left on device")
    d = Path(ctx.settings.data_dir) / "fill"
    d.mkdir(parents=True, exist_ok=True)
    chunk = b"\0" * (64 << 10)
    with (d / str(ctx.job.id)).open("wb") as fh:
        while True:
            fh.write(chunk)
            fh.flush()


def hog(ctx) -> dict:
    held = bytearray(int(ctx.payload["mib"]) << 20)
    for i in range(0, len(held), 4096):
        held[i] = 1
    result = _ticks(ctx, float(ctx.payload.get("seconds", 600)), 0.05)
    return {**result, "held": len(held)}


def oom(ctx) -> dict:
    import torch

    _ticks(ctx, float(ctx.payload.get("seconds", 0.3)), 0.05)
    raise torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 24 GiB")


def wedge(ctx) -> dict:
    """Write this process's pid to ``<data_dir>/wedge/<job>``, then hold the interpreter in C
    code (a regular expression that backtracks without end, as a user's pattern did in trial
    s22): no heartbeat, no signal handler runs until the process is killed."""
    import os
    import re

    out = Path(ctx.settings.data_dir) / "wedge"
    out.mkdir(parents=True, exist_ok=True)
    (out / str(ctx.job.id)).write_text(str(os.getpid()))
    re.search(r"(\s*\w+\s*)*\d", "word " * 60)
    return {}
