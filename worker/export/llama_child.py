"""Run llama.cpp (the GGUF quantiser, the GGUF verification) in a child process.

llama.cpp is native code: a build that does not fit the CPU (``-march=native`` from another
machine) dies with SIGSEGV/SIGILL, and a bad file can make it hang. Run in the worker's own
process, that kills the worker and every job it holds ("lease expired after 2 attempts"). So
:func:`call` runs one operation in ``python -m worker.export.llama_child`` (its own session, so
the whole process group is killed) under a wall-clock limit, and turns a crash, a timeout or an
error into an :class:`~worker.export.files.ExportError` that names the step and the signal; the
export fails alone and the worker keeps serving.

Protocol: the request ``{"op", "kwargs", "result"}`` as JSON on stdin; the child writes
``{"value": ...}`` or ``{"error": message}`` to the ``result`` path (not stdout, where native
code may print). Operations: :data:`OPS`.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from .files import ExportError

#: op -> "module:function"; each takes JSON-able keyword arguments and returns a JSON-able value.
OPS = {"quantize": "worker.export.quantize:quantize",
       "verify_gguf": "worker.export.verify:verify_gguf",
       "system_info": "worker.export.llama_build:system_info"}
_ROOT = Path(__file__).resolve().parents[2]


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def call(op: str, kwargs: dict, step: str, timeout: float | None = None,
         on_wait: Callable[[], None] | None = None,
         module: str = "worker.export.llama_child") -> object:
    """Run ``OPS[op](**kwargs)`` in a child process and return its value.

    ``step`` names the work in errors (e.g. ``"verifying model-Q4_K_M.gguf"``); ``timeout``
    seconds (default: the setting ``llama_cpp_timeout_seconds``,
    ``WHETSTONE_LLAMA_CPP_TIMEOUT_SECONDS``); ``on_wait()`` is called about every 2 s while the
    child runs (the job's cancel check: an exception from it kills the child and propagates).
    ``module`` is the child's entry module (tests substitute one that crashes).
    Raises :class:`ExportError`: the child's own error, a crash (``killed by SIGSEGV``), a
    non-zero exit, or the time limit.
    """
    if timeout is None:
        from app.settings import get_settings

        timeout = get_settings().llama_cpp_timeout_seconds
    with tempfile.TemporaryDirectory(prefix="llama-child-") as tmp:
        result = Path(tmp) / "result.json"
        err_path = Path(tmp) / "stderr.txt"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        with open(err_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=err, cwd=str(_ROOT),
                                    env=env, start_new_session=True)
            try:
                proc.stdin.write(json.dumps({"op": op, "kwargs": kwargs,
                                             "result": str(result)}).encode())
                proc.stdin.close()
                t0 = last = time.monotonic()
                while proc.poll() is None:
                    try:
                        proc.wait(timeout=0.2)
                    except subprocess.TimeoutExpired:
                        pass
                    now = time.monotonic()
                    if now - t0 > timeout:
                        raise ExportError(f"llama.cpp did not finish {step} within {timeout:.0f} s "
                                          "and was stopped; the worker is unaffected "
                                          "(WHETSTONE_LLAMA_CPP_TIMEOUT_SECONDS sets the limit)")
                    if on_wait and now - last >= 2.0:
                        last = now
                        on_wait()
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        tail = err_path.read_text(errors="replace").strip().splitlines()[-3:]
        if proc.returncode < 0:
            raise ExportError(f"llama.cpp crashed ({_signal_name(proc.returncode)}) while "
                              f"{step}; this export failed, the worker is unaffected. A "
                              "llama-cpp-python built for another CPU (-march=native) does this: "
                              "rebuild it on this machine")
        if not result.exists():
            raise ExportError(f"llama.cpp child exited with code {proc.returncode} while {step}"
                              + (f": {' | '.join(tail)}" if tail else ""))
        answer = json.loads(result.read_text())
    if "error" in answer:
        raise ExportError(answer["error"])
    return answer["value"]


def main() -> None:
    """Child side: read the request from stdin, run it, write the answer file."""
    req = json.loads(sys.stdin.read())
    mod, _, fn = OPS[req["op"]].partition(":")
    try:
        value = getattr(importlib.import_module(mod), fn)(**req["kwargs"])
        answer = {"value": value}
    except Exception as e:  # noqa: BLE001 - every failure goes back to the parent as text
        answer = {"error": str(e) if isinstance(e, ExportError)
                  else f"{type(e).__name__}: {e}"}
    tmp = Path(req["result"] + ".partial")
    tmp.write_text(json.dumps(answer))
    os.replace(tmp, req["result"])


if __name__ == "__main__":
    main()
