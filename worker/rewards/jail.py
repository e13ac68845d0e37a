"""The bubblewrap jail that custom reward code runs in: who it runs as, what it sees, its limits.

Built from Debian's ``bubblewrap`` (``bwrap``, the sandbox behind Flatpak): it needs no setuid
helper and no daemon, only unprivileged user namespaces, and it does the namespaces and mounts
while we keep the policy here. The jail has

* **its own user**: a worker running as root (as in Docker) drops to ``nobody`` (uid 65534)
  *before* starting bwrap, so the jail's processes are uid 65534 on the host too (not root
  mapped into a namespace, whose process count the kernel never limits). A worker running as a
  normal user cannot change uid; its jail runs as uid 65534 inside its own user namespace (the
  worker's uid outside) with every capability dropped;
* **nothing of the host but the read-only system**: ``/usr`` (and the ``/bin``, ``/lib*``
  links or folders), the Python interpreter's own prefix when it lives elsewhere, a fresh
  ``/proc`` of its own PID namespace, a minimal ``/dev`` and an empty tmpfs ``/tmp``. Never the
  checkout, the venv, the data dir or the database; the inputs go in over stdin;
* **no network** (a new, empty network namespace), **a clean environment** (``PATH``, ``LANG``);
* **one process tree**: a new PID namespace and ``--die-with-parent``; killing bwrap's process
  group (see :mod:`worker.rewards.sandbox`) ends every process of the call;
* **limits set by the admin** (:class:`Limits`, from the ``reward_*`` settings), applied by the
  child before any user code runs: address space, CPU seconds, processes, file size, no cores.
  The process limit counts the jail's own tasks: since Linux 5.14 ``RLIMIT_NPROC`` is counted
  per user namespace; older kernels count every process of the uid on the host, which makes it
  stricter (other processes of ``nobody``, or of the worker's user, use up the allowance).
"""
from __future__ import annotations

import os
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

#: The sandbox user when the worker runs as root (Debian's ``nobody``).
NOBODY = 65534

#: What every failure to build a jail says (custom rewards never run unsandboxed).
REQUIRED = ("custom reward functions run only inside a bubblewrap sandbox; "
            "install it on the worker host (apt-get install bubblewrap)")

#: What a jail that bwrap could not set up says.
NAMESPACES = ("bubblewrap needs unprivileged user namespaces on the worker host (in Docker: run "
              "the worker with security_opt seccomp=unconfined and apparmor=unconfined, or "
              "profiles that allow them)")


class JailUnavailable(RuntimeError):
    """The sandbox cannot be built on this host (no ``bwrap``, or no usable interpreter)."""


@dataclass(frozen=True)
class Limits:
    """Admin-set limits of one reward call (one batch of completions).

    ``memory_mb``: address space per process (MiB); ``cpu_seconds``: CPU time per process;
    ``timeout_s``: wall-clock seconds for the whole call (start, load, scoring);
    ``max_processes``: processes the reward may start besides itself; ``file_mb``: largest
    file it may write in its private ``/tmp`` (MiB).
    """

    memory_mb: int = 1024
    cpu_seconds: int = 30
    timeout_s: float = 30.0
    max_processes: int = 16
    file_mb: int = 16

    @classmethod
    def from_settings(cls, settings) -> "Limits":
        """The limits in an :class:`app.settings.Settings` (``reward_*`` fields)."""
        return cls(memory_mb=settings.reward_memory_mb, cpu_seconds=settings.reward_cpu_seconds,
                   timeout_s=settings.reward_timeout_seconds,
                   max_processes=settings.reward_max_processes)


def _others_can(path: str, bits: int) -> bool:
    """Whether a user who is neither owner nor group member may do ``bits`` on ``path`` and
    traverse every folder above it."""
    p = Path(path)
    try:
        if os.stat(p).st_mode & bits != bits:
            return False
        return all(os.stat(d).st_mode & stat.S_IXOTH for d in p.parents)
    except OSError:
        return False


def _interpreter(drop: bool) -> str:
    """The real path of a Python the jail's user can run: this worker's, else the system's."""
    seen = []
    for cand in (sys.executable, "/usr/bin/python3"):
        exe = os.path.realpath(cand)
        seen.append(exe)
        ok = _others_can(exe, stat.S_IROTH | stat.S_IXOTH) if drop else os.access(exe, os.X_OK)
        if ok:
            return exe
    who = f"uid {NOBODY}" if drop else "the worker's user"
    raise JailUnavailable(f"no Python interpreter that the reward sandbox ({who}) can run: "
                          f"tried {', '.join(seen)}")


def _system_mounts() -> list[str]:
    """Read-only ``/usr`` plus ``/bin``, ``/sbin``, ``/lib*`` as the host has them (links or
    folders), and the dynamic loader's cache."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args + ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]


@dataclass
class Jail:
    """A ready-to-start jail: ``argv`` for Popen, the Popen user/group, the child's limits."""

    argv: list[str]
    user: int | None
    limits: dict


def build(child_code: str, limits: Limits) -> Jail:
    """The bwrap command that runs ``child_code`` (Python source) under ``limits``.

    Raises JailUnavailable when ``bwrap`` is not installed or no interpreter is usable.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise JailUnavailable(f"bubblewrap (bwrap) is not installed: {REQUIRED}")
    drop = os.geteuid() == 0
    exe = _interpreter(drop)
    argv = [bwrap, "--unshare-all", "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY),
            "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
            *_system_mounts(), "--proc", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--chdir", "/tmp"]
    prefix = os.path.dirname(os.path.dirname(exe))
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        argv += ["--ro-bind", prefix, prefix]
    argv += [exe, "-I", "-S", "-c", child_code]
    return Jail(argv, NOBODY if drop else None,
                {"memory_mb": limits.memory_mb, "cpu_s": limits.cpu_seconds,
                 "processes": limits.max_processes, "file_mb": limits.file_mb})
