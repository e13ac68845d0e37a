"""The supervisor's GPU sampler: every ``settings.gpu_sample_seconds`` one
:class:`app.store.schema.GpuSample` per slot (utilisation %, memory used/total GiB, temperature °C,
power W, the jobs running there), written to the database for the GPU dashboard.

* A real GPU is read through NVML (nvidia-ml-py), by the slot's NVML index; a figure the device
  does not report (power on some boards) is None.
* A simulated GPU (``settings.simulated_gpus``, tests) reports the memory admitted to the jobs
  running on it as used and its simulated size as total; the rest is unknown (None).
* The CPU slot of a box without a GPU reports the host's CPU utilisation and RAM.
"""
from __future__ import annotations

import logging
import socket
from collections.abc import Mapping, Sequence

from app.store.admission import Slot
from app.store.schema import GpuSample, now

log = logging.getLogger("worker.gpu_samples")


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no NVML (CPU box, container without the driver)
        return None


def _try(fn, *args, scale: float = 1.0) -> float | None:
    try:
        return round(float(fn(*args)) * scale, 3)
    except Exception:  # noqa: BLE001 - a figure this device does not report
        return None


class Sampler:
    """Measures a supervisor's slots; :meth:`sample` returns the rows to write.

    Args:
        slots: the supervisor's slots (``index`` is the NVML index; None: the CPU slot).
        labels: device label per slot id (``cuda:0 NVIDIA H200``).
        simulated: the slots are simulated GPUs (no NVML is opened).
    """

    def __init__(self, slots: Sequence[Slot], labels: Mapping[str, str], simulated: bool):
        self.slots, self.labels, self.simulated = list(slots), dict(labels), simulated
        self.host = socket.gethostname()
        real = not simulated and any(s.index is not None for s in self.slots)
        self.nvml = _nvml() if real else None
        if any(s.index is None for s in self.slots):
            self._cpu_percent()  # psutil's first reading is meaningless; prime it

    @staticmethod
    def _cpu_percent() -> float | None:
        try:
            import psutil

            return psutil.cpu_percent(interval=None)
        except Exception:  # noqa: BLE001
            return None

    def _measure(self, slot: Slot, held_gib: float) -> dict:
        if slot.index is None:  # the CPU slot: host utilisation and RAM
            try:
                import psutil

                vm = psutil.virtual_memory()
                mem = {"mem_used_gib": round((vm.total - vm.available) / 2**30, 3),
                       "mem_total_gib": round(vm.total / 2**30, 3)}
            except Exception:  # noqa: BLE001
                mem = {}
            return {"source": "cpu", "util_pct": self._cpu_percent(), **mem}
        if self.simulated or self.nvml is None:
            return {"source": "simulated" if self.simulated else "unknown",
                    "mem_used_gib": round(held_gib, 3), "mem_total_gib": slot.total_gib}
        nv = self.nvml
        try:
            h = nv.nvmlDeviceGetHandleByIndex(slot.index)
        except Exception as exc:  # noqa: BLE001
            log.warning("NVML cannot open GPU %s: %s", slot.index, exc)
            return {"source": "nvml", "mem_total_gib": slot.total_gib}
        try:
            info = nv.nvmlDeviceGetMemoryInfo(h)
            mem = {"mem_used_gib": round(info.used / 2**30, 3),
                   "mem_total_gib": round(info.total / 2**30, 3)}
        except Exception:  # noqa: BLE001
            mem = {"mem_total_gib": slot.total_gib}
        return {"source": "nvml", **mem,
                "util_pct": _try(lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                "temp_c": _try(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                "power_w": _try(nv.nvmlDeviceGetPowerUsage, h, scale=1e-3)}  # mW -> W

    def sample(self, running: Mapping[str, Sequence[tuple[int, float | None]]]) -> list[GpuSample]:
        """One sample per slot, taken now. ``running`` maps a slot id to its jobs as
        ``(job id, admitted GiB)`` pairs (the admitted sum is a simulated GPU's memory used)."""
        t, out = now(), []
        for slot in self.slots:
            jobs = list(running.get(slot.id, ()))
            figures = self._measure(slot, sum(g or 0.0 for _, g in jobs))
            out.append(GpuSample(ts=t, slot=slot.id, host=slot.host or self.host,
                                 gpu_index=slot.index, name=self.labels.get(slot.id, ""),
                                 jobs=sorted(j for j, _ in jobs), **figures))
        return out

    def close(self) -> None:
        """Release NVML (when it was opened)."""
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self.nvml = None
