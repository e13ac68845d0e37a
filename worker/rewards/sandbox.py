"""Custom reward functions written in the browser, run in a separate, limited process.

The user's code defines ``def reward(prompt: str, completion: str, item: dict) -> float``
(``item`` holds the dataset row's columns; OpenAI ``python`` graders use
``def grade(sample: dict, item: dict) -> float`` with ``sample["output_text"]``). It runs in a
child ``python -I`` process — not in the worker — with:

* an address-space limit (``RLIMIT_AS``, ``memory_mb``): allocating past it raises MemoryError;
* a wall-clock limit per batch (``timeout_s`` per call of the whole batch): past it the
  process is killed and the run stops; a CPU-time limit (``RLIMIT_CPU``) backs it up;
* no worker state: an empty environment (no ``WHETSTONE_*``/database settings), a temporary
  working directory, no core dumps, files capped at 16 MiB.

It is not a security boundary against a hostile user (the network and the file system are
reachable), which is why an admin allows custom rewards per user
(``WHETSTONE_ALLOW_CUSTOM_REWARDS``). Every failure raises RewardError naming the function and
the offending sample.
"""
from __future__ import annotations

import collections
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from worker.rewards.base import Batch, RewardError, RewardFunction

CHILD = Path(__file__).with_name("_sandbox_child.py")

#: What the run form shows about custom rewards.
SIGNATURE = "def reward(prompt: str, completion: str, item: dict) -> float"


class SandboxedReward(RewardFunction):
    """A custom reward in its own process (started on first use, reused across batches)."""

    def __init__(self, name: str, source: str, *, entry: str = "reward", style: str = "reward",
                 weight: float = 1.0, timeout_s: float = 5.0, memory_mb: int = 512):
        self.name, self.weight = name, weight
        self.source, self.entry, self.style = source, entry, style
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self._proc: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._stderr: collections.deque[str] = collections.deque(maxlen=40)
        self._buf = b""

    # ---- process ---------------------------------------------------------------------
    def _start(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="whetstone-reward-")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "HOME": self._tmp.name}
        self._proc = subprocess.Popen([sys.executable, "-I", str(CHILD)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      cwd=self._tmp.name, env=env, start_new_session=True)
        threading.Thread(target=self._drain, args=(self._proc,), daemon=True).start()
        self._send({"source": self.source, "entry": self.entry, "style": self.style,
                    "memory_mb": self.memory_mb})
        reply = self._recv(max(self.timeout_s, 10.0), "starting")
        if "error" in reply:
            self.close()
            raise RewardError(self.name, f"could not be loaded: {reply['error']}")

    def _drain(self, proc: subprocess.Popen) -> None:
        for line in iter(proc.stderr.readline, b""):
            self._stderr.append(line.decode("utf-8", "replace").rstrip())

    def _send(self, obj: dict) -> None:
        try:
            self._proc.stdin.write((json.dumps(obj) + "\n").encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._died("stopped before it got its input")

    def _recv(self, timeout: float, what: str) -> dict:
        end = time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = end - time.monotonic()
            if left <= 0:
                self.close()
                raise RewardError(self.name, f"took longer than its {timeout:g} s limit "
                                             f"({what}); the sandbox process was killed")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self._died(what)
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _died(self, what: str) -> None:
        proc = self._proc
        code = proc.wait(timeout=5) if proc else None
        tail = "; ".join(list(self._stderr)[-3:])
        why = {-signal.SIGXCPU: "ran out of CPU time", -signal.SIGKILL: "was killed",
               -signal.SIGSEGV: "crashed"}.get(code, f"exited with code {code}")
        self.close()
        raise RewardError(self.name, f"sandbox process {why} ({what})" + (f": {tail}" if tail
                                                                           else ""))

    def close(self) -> None:
        proc, self._proc = self._proc, None
        self._buf = b""
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            proc.wait(timeout=10)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ---- scoring ---------------------------------------------------------------------
    def score(self, batch: Batch) -> list:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        samples = [{"prompt": batch.prompts[i], "completion": batch.completions[i],
                    "item": {c: v[i] for c, v in batch.columns.items()}}
                   for i in range(len(batch))]
        self._send({"samples": samples, "cpu_s": int(self.timeout_s) + 1})
        reply = self._recv(self.timeout_s, f"scoring {len(batch)} completions")
        if "error" in reply:
            idx = reply.get("index")
            sample = batch.sample(idx) if isinstance(idx, int) and idx < len(batch) else None
            raise RewardError(self.name, f"raised {reply['error']}", sample)
        out = []
        for enc in reply["values"]:
            if enc[0] == "num":
                out.append(enc[1])
            elif enc[0] == "none":
                out.append(None)
            else:
                out.append(_Opaque(enc[1], enc[2]))
        return out


class _Opaque:
    """A non-number the sandbox returned, carried back only to be reported by validate()."""

    def __init__(self, type_name: str, text: str):
        self.type_name, self.text = type_name, text

    def __repr__(self) -> str:
        return self.text


def make_custom(name: str, params: dict, weight: float = 1.0) -> SandboxedReward:
    """A SandboxedReward from a ``custom`` RewardSpec's params."""
    return SandboxedReward(name, params["source"], entry=params.get("entry", "reward"),
                           style=params.get("style", "reward"), weight=weight,
                           timeout_s=params.get("timeout_s", 5.0),
                           memory_mb=params.get("memory_mb", 512))
