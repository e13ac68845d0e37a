"""The supervisor of a host's GPUs (``python -m worker --supervise``): admits queued GPU jobs by
their estimated memory, several at once per GPU, and runs each admitted job in its own process.

* At start: what a worker does (migrate, register, reap, seed the demo model), then one worker
  row per GPU *slot* (``<id>-gpu<i>``: its total memory and its capacity, the total less
  ``settings.gpu_reserve_gib``), the jobs a previous supervisor of this id left leased to its
  slots are reaped (its job processes are gone), and the CPU lane starts (exports, imports,
  dataset validation; :meth:`worker.loop.Worker.start_cpu_lane`).
* Every poll, for every slot: :func:`app.store.queue.admit` claims the next admissible job (fits
  beside the jobs running there, owner within quota, fair share; :mod:`app.store.admission`) and
  a child ``python -m worker.child`` runs it with ``CUDA_VISIBLE_DEVICES`` pinned to that GPU.
  A data-parallel job (``num_gpus`` N > 1) is admitted onto N slots of this host at once and its
  child sees those N GPUs: it launches N ranks through torchrun (worker/ddp.py) and holds the
  lease for all of them; when it exits, every one of its slots is free again.
  The child holds the job's lease (heartbeat, cancel, fencing) under the owner the claim wrote;
  its CUDA allocator is capped at the admitted memory, and the engine's ``vram_budget_gib`` too.
* A child that runs out of memory fails its job alone with the estimate, the measured peak and
  what to lower (worker/child.py), and exits: its memory is freed and the next job is admitted.
  A child that dies without ending its job (killed by the kernel's OOM killer, a signal) has its
  job reaped at once: requeued while attempts remain, with the cause.
* A child that outlives its claim on the job (the job ended, or was reaped because the child's
  heartbeat stopped: a process stuck in C code that holds the interpreter, e.g. a regular
  expression that backtracks without end) still holds its GPU memory: its slots admit nothing
  until it exits; after ``settings.orphan_grace_seconds`` it is sent SIGTERM, after as long
  again SIGKILL (:meth:`Supervisor.collect`).
* SIGTERM/SIGINT: every child stops at its next check (training checkpoints), its job goes back
  to the queue; then the lane stops and the rows are removed.
* ``settings.simulated_gpus`` (tests only, e.g. ``2x24``) gives a CPU box simulated GPUs of that
  size; without a GPU or a simulation the host has one CPU slot that runs one job at a time.
* Every ``settings.gpu_sample_seconds`` each slot's figures (NVML utilisation, memory,
  temperature, power, its running jobs) are written to ``gpu_samples`` for the GPU dashboard
  (worker/gpu_samples.py); a sampling fault is logged and never stops admission.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from app.settings import Settings
from app.store import gpu_samples as samples_store
from app.store import queue, workers
from app.store.admission import Slot
from worker import faults, gpu
from worker.gpu_samples import Sampler
from worker.loop import CPU_KINDS, HANDLERS, Worker, one_line

log = logging.getLogger("worker.supervisor")

#: Seconds added to the lease an admission writes, for the child process to start (imports on a
#: loaded host) before its own first heartbeat.
CHILD_START_SECONDS = 60.0
#: Seconds a stopping child gets to checkpoint and hand its job back before it is killed.
STOP_GRACE_SECONDS = 120.0


def parse_simulated(spec: str) -> list[float]:
    """``"2x24"`` -> ``[24.0, 24.0]``; ``"24,80"`` -> ``[24.0, 80.0]`` (GiB a GPU)."""
    out: list[float] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        n, _, size = part.rpartition("x")
        out += [float(size)] * (int(n) if n else 1)
    return out


def _nvml_gpus() -> list[tuple[int, str, float]] | None:
    """``[(index, name, total GiB)]`` of the GPUs NVML sees (in PCI order, as
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` numbers them), limited to ``CUDA_VISIBLE_DEVICES`` when it
    lists indices; None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML: no GPU, or no driver in this container
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            out.append((i, name, pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30))
    finally:
        pynvml.nvmlShutdown()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        if all(v.isdigit() for v in wanted):
            out = [g for g in out if str(g[0]) in wanted]
    return out


def discover(settings: Settings, supervisor_id: str) -> list[tuple[Slot, str]]:
    """This host's slots with their device labels: the simulated GPUs, the NVIDIA GPUs, or one
    CPU slot (capacity None)."""
    host, reserve = socket.gethostname(), settings.gpu_reserve_gib
    if settings.simulated_gpus:
        sizes = parse_simulated(settings.simulated_gpus)
        return [(Slot(f"{supervisor_id}-gpu{i}", host, i, max(0.0, size - reserve), size),
                 f"cuda:{i} simulated GPU ({size:g} GiB)") for i, size in enumerate(sizes)]
    gpus = _nvml_gpus() if os.environ.get("CUDA_VISIBLE_DEVICES") != "" else []
    if gpus is None and gpu.cuda_available():  # no NVML: ask torch (numbers as it sees them)
        torch = gpu._torch()
        gpus = [(i, torch.cuda.get_device_name(i),
                 torch.cuda.get_device_properties(i).total_memory / 2**30)
                for i in range(torch.cuda.device_count())]
    if gpus:
        return [(Slot(f"{supervisor_id}-gpu{i}", host, i, max(0.0, total - reserve),
                      round(total, 2)), f"cuda:{i} {name}") for i, name, total in gpus]
    return [(Slot(f"{supervisor_id}-main", host, None, None, None),
             f"cpu slot ({os.cpu_count() or 1} cores, one job at a time)")]


@dataclass
class Child:
    """One admitted job's process."""

    job_id: int
    owner: str
    slot: Slot
    proc: subprocess.Popen
    admitted_gib: float | None = None
    #: every slot the job holds (a data-parallel job: several; else ``[slot]``)
    slots: list[Slot] | None = None
    #: monotonic seconds since which the process has outlived its claim on the job (None: not)
    orphan_since: float | None = None
    #: the signal last sent to an orphaned process (SIGTERM, then SIGKILL), once each
    signalled: int | None = None

    def slot_list(self) -> list[Slot]:
        """The slots this child's job holds."""
        return self.slots or [self.slot]


class Supervisor:
    """Admits GPU jobs onto this host's slots and runs each in a child process."""

    def __init__(self, settings: Settings, supervisor_id: str | None = None,
                 kinds: list[str] | None = None, poll_interval: float = 1.0):
        self.settings = settings
        self.id = supervisor_id or socket.gethostname()
        self.kinds = kinds or [k for k in sorted(HANDLERS) if k not in CPU_KINDS]
        self.poll_interval = poll_interval
        # the process's own worker row, reaper, migration and CPU lane (it claims nothing itself)
        self.base = Worker(settings, self.id, list(CPU_KINDS), poll_interval)
        self.shutdown = self.base.shutdown
        self.engine = None
        self.slots: list[Slot] = []
        self.children: list[Child] = []
        self._lock = threading.Lock()
        self.sampler: Sampler | None = None
        self._sampled_at = float("-inf")  # monotonic seconds of the last GPU sample

    def start(self) -> None:
        """Start as a worker, register the slots, reap what this id's previous process left."""
        self.base.start()
        self.engine = self.base.engine
        labels = {}
        for slot, label in discover(self.settings, self.id):
            labels[slot.id] = label
            self.base.retry_start(f"register slot {slot.id}", lambda: workers.register(
                self.engine, slot.id, slot.host, os.getpid(), label, slot.total_gib, slot.index,
                slot.capacity_gib))
            reaped = self.base.retry_start("reap expired leases", lambda: queue.reap(
                self.engine, restarted=slot.id, restarted_prefix=f"{slot.id}:"))
            for job_id, state in reaped:
                log.warning("reaped job %s of a previous supervisor -> %s", job_id, state)
            self.slots.append(slot)
        self.sampler = Sampler(self.slots, labels, bool(self.settings.simulated_gpus))
        log.info("supervisor %s: %s (admits %s)", self.id, ", ".join(
            f"{s.id} {s.capacity_gib if s.capacity_gib is not None else 'cpu'}"
            + (" GiB" if s.capacity_gib is not None else "") for s in self.slots),
            ", ".join(self.kinds))

    def start_cpu_lane(self) -> Worker:
        """Start the CPU lane (see :meth:`worker.loop.Worker.start_cpu_lane`)."""
        return self.base.start_cpu_lane()

    def request_shutdown(self) -> None:
        """Stop admitting; :meth:`serve` then stops the children and returns."""
        self.shutdown.set()

    # ---- children ------------------------------------------------------------------------
    def spawn(self, slot: Slot, job) -> Child:
        """Start ``python -m worker.child`` for an admitted job on ``slot`` (and, for a
        data-parallel job, on the other slots its ``gpu_slot`` lists)."""
        from app.store.admission import slot_ids

        ids = slot_ids(job) or [slot.id]
        held = [next((s for s in self.slots if s.id == i), slot) for i in ids]
        env = {"TRITON_CACHE_DIR": str(self.settings.kernel_cache_dir), **os.environ,
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
               "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
               "CUDA_VISIBLE_DEVICES": "" if self.settings.simulated_gpus or slot.index is None
               else ",".join(str(s.index) for s in held)}
        cmd = [sys.executable, "-m", "worker.child", "--job", str(job.id),
               "--lease-owner", job.lease_owner, "--handlers", json.dumps(HANDLERS)]
        proc = subprocess.Popen(cmd, env=env)
        child = Child(job.id, job.lease_owner, slot, proc, job.admitted_gib, held)
        with self._lock:
            self.children.append(child)
        log.info("job %s (%s) admitted on %s with %s GiB: pid %s", job.id, job.kind,
                 ",".join(ids), job.admitted_gib, proc.pid)
        return child

    def collect(self) -> int:
        """Forget children that exited; a job its process left running (killed, crashed) is
        reaped now with the cause. Returns how many exited."""
        with self._lock:
            done = [c for c in self.children if c.proc.poll() is not None]
            self.children = [c for c in self.children if c not in done]
        for c in done:
            job = queue.get_job(self.engine, c.job_id)
            if job.state == "running" and job.lease_owner == c.owner:
                log.warning("job %s: its process exited with %s without ending it", c.job_id,
                            c.proc.returncode)
                queue.reap(self.engine, restarted=c.owner, gone={c.owner})
        self._stop_orphans()
        return len(done)

    def _stop_orphans(self) -> None:
        """Children still running whose job is no longer theirs (ended, or reaped because
        their heartbeat stopped): SIGTERM after ``orphan_grace_seconds``, SIGKILL after twice
        that; until they exit their slots admit nothing (:meth:`orphan_slots`)."""
        grace = self.settings.orphan_grace_seconds
        with self._lock:
            alive = [c for c in self.children if c.proc.poll() is None]
        for c in alive:
            try:
                job = queue.get_job(self.engine, c.job_id)
                mine = job.state == "running" and job.lease_owner == c.owner
            except queue.JobNotFound:
                mine = False
            t = time.monotonic()
            if mine:
                c.orphan_since = None
            elif c.orphan_since is None:
                c.orphan_since = t
            elif t - c.orphan_since >= 2 * grace and c.signalled != signal.SIGKILL:
                log.error("job %s: its process %s still runs %.0f s after its claim ended; "
                          "killing it", c.job_id, c.proc.pid, t - c.orphan_since)
                c.signalled = signal.SIGKILL
                c.proc.kill()
            elif t - c.orphan_since >= grace and c.signalled is None:
                c.signalled = signal.SIGTERM
                log.warning("job %s: its process %s outlived its claim by %.0f s (its heartbeat "
                            "stopped?); sending SIGTERM", c.job_id, c.proc.pid, t - c.orphan_since)
                c.proc.terminate()

    def orphan_slots(self) -> set[str]:
        """The ids of the slots a child holds that outlived its claim (its memory is still in
        use although the job's row no longer counts it)."""
        with self._lock:
            return {s.id for c in self.children if c.orphan_since is not None
                    and c.proc.poll() is None for s in c.slot_list()}

    def claims(self) -> list[tuple[int, str, tuple[str, ...]]]:
        """``(job id, lease owner, slot ids)`` of every child still running: admission re-checks
        them inside its transaction (:func:`app.store.queue.admit`), so a job reaped after
        :meth:`orphan_slots` looked does not free its slot while its process lives."""
        with self._lock:
            return [(c.job_id, c.owner, tuple(s.id for s in c.slot_list()))
                    for c in self.children if c.proc.poll() is None]

    def admit_all(self) -> int:
        """Admit onto every slot as many jobs as fit now; returns how many were admitted."""
        n = 0
        held = self.orphan_slots()  # still in use by a process its job no longer counts
        free = [s for s in self.slots if s.id not in held]
        for slot in free:
            while not self.shutdown.is_set():
                job = queue.admit(self.engine, slot,
                                  self.settings.lease_seconds + CHILD_START_SECONDS, self.kinds,
                                  self.settings.gpu_admit_margin, self.settings.fair_share_hours,
                                  peers=free, claims=self.claims())
                if job is None:
                    break
                self.spawn(slot, job)
                n += 1
        return n

    def touch(self) -> None:
        """Refresh the process's and the slots' worker rows (a slot names one of its jobs)."""
        workers.touch(self.engine, self.id, None)
        with self._lock:
            on = {s.id: c.job_id for c in self.children for s in c.slot_list()}
        for slot in self.slots:
            workers.touch(self.engine, slot.id, on.get(slot.id))

    def sample(self) -> int:
        """Write one GPU sample per slot (:mod:`worker.gpu_samples`) and prune the table to
        its window. Returns how many samples were written."""
        self._sampled_at = time.monotonic()
        if self.sampler is None:
            return 0
        with self._lock:
            running: dict[str, list[tuple[int, float | None]]] = {}
            for c in self.children:
                for s in c.slot_list():
                    running.setdefault(s.id, []).append((c.job_id, c.admitted_gib))
        rows = self.sampler.sample(running)
        samples_store.record(self.engine, rows)
        return len(rows)

    def _sample_if_due(self) -> None:
        if time.monotonic() - self._sampled_at < self.settings.gpu_sample_seconds:
            return
        try:
            self.sample()
        except Exception as exc:  # noqa: BLE001 - the dashboard may miss a point, admission not
            log.warning("could not write the GPU samples: %s", one_line(exc))

    def serve(self, once: bool = False) -> int:
        """Admit and supervise until shutdown, then stop the children. Returns 0. A database
        or disk fault never ends the loop (logged, backed off); with less than
        :data:`worker.faults.MIN_FREE_BYTES` free in the data dir nothing is admitted."""
        backoff = faults.Backoff()
        while not self.shutdown.is_set():
            try:
                self.collect()
                free = faults.free_bytes(self.settings.data_dir)
                if not 0 <= free < faults.MIN_FREE_BYTES:
                    self.admit_all()
                self.touch()
                self._sample_if_due()
                backoff.reset()
                self.shutdown.wait(self.poll_interval)
            except Exception as exc:  # noqa: BLE001 - back off, keep supervising
                delay = backoff.delay()
                log.error("cannot admit (%s); retrying in %.0f s",
                          faults.describe(exc, self.settings.data_dir) or one_line(exc), delay)
                self.shutdown.wait(delay)
        self.stop_children(self.settings.stop_grace_seconds)
        return 0

    def stop_children(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM every child (its job checkpoints and goes back to the queue), wait up to
        ``grace`` seconds, kill what is left and give its job back to the queue saying why
        (trial s27: the reaper of the next start called it "killed (likely out of memory)"),
        reap what the others left running."""
        with self._lock:
            children = list(self.children)
        for c in children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in children:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(10)
                reason = (f"the worker was stopping and the job did not stop within {grace:g} s, "
                          "so it was ended; it resumes from its last checkpoint")
                try:
                    if queue.release(self.engine, c.job_id, c.owner, reason):
                        log.warning("job %s: %s", c.job_id, reason)
                except Exception:  # noqa: BLE001 - the reaper of the next start will
                    log.exception("could not give job %s back to the queue", c.job_id)
        try:
            self.collect()
        except Exception:  # noqa: BLE001 - the reaper of the next start will
            log.exception("could not collect the stopped children")

    def stop(self) -> None:
        """Stop the lane and the reaper, remove this process's and its slots' rows."""
        self.base.stop()
        if self.sampler is not None:
            self.sampler.close()
        for slot in self.slots:
            try:
                workers.unregister(self.engine, slot.id)
            except Exception:  # noqa: BLE001
                log.exception("could not unregister slot %s", slot.id)
