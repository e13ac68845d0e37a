"""Custom reward functions written in the browser, run in a bubblewrap jail, one per batch.

The user's code defines ``def reward(prompt: str, completion: str, item: dict) -> float``
(``item`` holds the dataset row's columns; OpenAI ``python`` graders use
``def grade(sample: dict, item: dict) -> float`` with ``sample["output_text"]``). Each call of
:meth:`SandboxedReward.score` (one batch of completions) starts a fresh jail
(:mod:`worker.rewards.jail`: another uid, no network, no view of the checkout, venv, data dir or
database, a clean environment, the standard library only), sends the code and the batch over
stdin, reads the rewards, and kills the jail's whole process tree. Its limits are the admin's
``reward_*`` settings, never the submitter's: past the memory limit the code gets MemoryError,
past the CPU or wall-clock limit it is killed, past the process limit ``fork`` fails.

Starting a jail costs about 36 ms (measured on a 2-core CPU box: a batch of 8 or 64 trivial
completions took 36-37 ms; the former unsandboxed process took 41 ms to start, then 0.1 ms per
batch while reused), paid once per batch, not per completion — small beside a GRPO step. Every failure raises RewardError naming the function (and the
offending sample where there is one); without bubblewrap custom rewards fail, never run bare.
"""
from __future__ import annotations

import collections
import json
import os
import select
import signal
import subprocess
import threading
import time
from pathlib import Path

from worker.rewards import jail
from worker.rewards.base import Batch, RewardError, RewardFunction

CHILD = Path(__file__).with_name("_sandbox_child.py")

#: What the run form shows about custom rewards.
SIGNATURE = "def reward(prompt: str, completion: str, item: dict) -> float"

#: bwrap exits with 128 + the signal that ended the reward's process.
_SIGNALLED = {128 + signal.SIGXCPU: "ran out of CPU time", 128 + signal.SIGKILL: "was killed",
              128 + signal.SIGSEGV: "crashed"}


class SandboxedReward(RewardFunction):
    """A custom reward scored in a fresh jail per batch, under the admin's ``limits``
    (:class:`worker.rewards.jail.Limits`; the defaults when None)."""

    def __init__(self, name: str, source: str, *, entry: str = "reward", style: str = "reward",
                 weight: float = 1.0, limits: jail.Limits | None = None):
        self.name, self.weight = name, weight
        self.source, self.entry, self.style = source, entry, style
        self.limits = limits or jail.Limits()
        self._proc: subprocess.Popen | None = None
        self._stderr: collections.deque[str] = collections.deque(maxlen=40)
        self._buf = b""
        self._drainer: threading.Thread | None = None

    # ---- process ---------------------------------------------------------------------
    def _start(self, deadline: float) -> None:
        try:
            spec = jail.build(CHILD.read_text(), self.limits)
        except jail.JailUnavailable as exc:
            raise RewardError(self.name, f"cannot run: {exc}") from None
        self._stderr.clear()
        self._proc = subprocess.Popen(spec.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True,
                                      user=spec.user, group=spec.user,
                                      extra_groups=[] if spec.user is not None else None)
        self._drainer = threading.Thread(target=self._drain, args=(self._proc,), daemon=True)
        self._drainer.start()
        self._send({"source": self.source, "entry": self.entry, "style": self.style,
                    "limits": spec.limits})
        reply = self._recv(deadline, "starting")
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

    def _recv(self, deadline: float, what: str) -> dict:
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise RewardError(self.name, f"took longer than the {self.limits.timeout_s:g} s "
                                             f"limit set by the admin ({what}); the sandbox was "
                                             f"killed")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self._died(what)
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply = json.loads(line)
        if reply.get("error") == "cpu":
            self.close()
            raise RewardError(self.name, self._cpu_message(what))
        return reply

    def _cpu_message(self, what: str) -> str:
        return (f"ran out of CPU time: the limit set by the admin is {self.limits.cpu_seconds} s "
                f"({what}); the sandbox was killed")

    def _died(self, what: str) -> None:
        proc = self._proc
        code = proc.wait(timeout=5) if proc else None
        if self._drainer is not None:
            self._drainer.join(timeout=2)  # its last words (bwrap's own errors) first
        tail = "; ".join(list(self._stderr)[-3:])
        self.close()
        if code == 128 + signal.SIGXCPU:
            raise RewardError(self.name, self._cpu_message(what))
        why = _SIGNALLED.get(code, f"exited with code {code}")
        if tail.startswith("bwrap:"):  # the jail itself could not be set up
            raise RewardError(self.name, f"cannot run: the sandbox did not start ({tail}); "
                                         f"{jail.NAMESPACES}")
        raise RewardError(self.name, f"sandbox process {why} ({what})" + (f": {tail}" if tail
                                                                           else ""))

    def close(self) -> None:
        """Kill the jail's process tree (bwrap's group; its PID namespace dies with it)."""
        proc, self._proc = self._proc, None
        self._buf = b""
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
        proc.wait(timeout=10)
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    # ---- scoring ---------------------------------------------------------------------
    def score(self, batch: Batch) -> list:
        """Rewards of ``batch`` (numbers, None or opaque values, for validate()); raises
        RewardError when the code fails, breaks a limit or the jail cannot start."""
        deadline = time.monotonic() + self.limits.timeout_s
        self.close()
        self._start(deadline)
        try:
            samples = [{"prompt": batch.prompts[i], "completion": batch.completions[i],
                        "item": {c: v[i] for c, v in batch.columns.items()}}
                       for i in range(len(batch))]
            self._send({"samples": samples})
            reply = self._recv(deadline, f"scoring {len(batch)} completions")
        finally:
            self.close()
        if "error" in reply:
            idx = reply.get("index")
            sample = batch.sample(idx) if isinstance(idx, int) and idx < len(batch) else None
            problem = reply["error"]
            if problem.startswith("MemoryError"):
                problem = (f"{problem.rstrip(': ')} (past the memory limit of "
                           f"{self.limits.memory_mb} MiB set by the admin)")
            raise RewardError(self.name, f"raised {problem}", sample)
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
    """A SandboxedReward from a ``custom`` RewardSpec's params, under the worker's ``reward_*``
    settings (any limits a stored spec still carries are ignored)."""
    from app.settings import get_settings

    return SandboxedReward(name, params["source"], entry=params.get("entry", "reward"),
                           style=params.get("style", "reward"), weight=weight,
                           limits=jail.Limits.from_settings(get_settings()))
