"""Which device the worker runs on and how much memory it uses (GPU when present, else RSS).

Every probe degrades gracefully: no CUDA, no pynvml or no torch simply means the CPU path.
"""
from __future__ import annotations

import os
import platform


def _torch():
    try:
        import torch

        return torch
    except Exception:  # noqa: BLE001 - torch missing or broken: CPU reporting still works
        return None


def cuda_available() -> bool:
    """True when torch sees at least one CUDA device."""
    torch = _torch()
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def local_index() -> int:
    """The CUDA device this process computes on: its ``LOCAL_RANK`` in a data-parallel run
    started by torchrun (worker/ddp.py), else 0."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return int(os.environ.get("LOCAL_RANK", "0"))
    return 0


def cuda_device() -> str:
    """``cuda:<local_index()>``: where this process loads its model."""
    return f"cuda:{local_index()}"


def device_name() -> str:
    """A human-readable device label, e.g. ``cuda:0 NVIDIA H200`` or ``cpu (16 cores)``."""
    if cuda_available():
        torch = _torch()
        try:
            i = local_index()
            return f"cuda:{i} {torch.cuda.get_device_name(i)}"
        except Exception:  # noqa: BLE001
            return cuda_device()
    return f"cpu ({os.cpu_count() or 1} cores, {platform.machine()})"


def _nvml_handle(pynvml):
    listed = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")
    visible = (listed[local_index()] if local_index() < len(listed) else listed[0]).strip() or "0"
    return (pynvml.nvmlDeviceGetHandleByIndex(int(visible)) if visible.isdigit()
            else pynvml.nvmlDeviceGetHandleByUUID(visible))


def _nvml_used_gib() -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetMemoryInfo(_nvml_handle(pynvml)).used / 2**30
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML (CPU box, container without driver)
        return None


def rss_gib() -> float:
    """Resident set size of this process in GiB (0.0 when psutil is missing)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**30
    except Exception:  # noqa: BLE001
        return 0.0


def memory() -> tuple[float, str]:
    """``(GiB, kind)``: GPU memory reserved by torch (or used per NVML) when CUDA is present,
    else the process RSS with kind ``rss``."""
    if cuda_available():
        torch = _torch()
        try:
            return torch.cuda.memory_reserved(local_index()) / 2**30, "gpu"
        except Exception:  # noqa: BLE001
            used = _nvml_used_gib()
            if used is not None:
                return used, "gpu"
    return rss_gib(), "rss"


def peak_memory_gib() -> tuple[float, str]:
    """Peak GPU memory allocated by torch when CUDA is present, else current RSS."""
    if cuda_available():
        try:
            return _torch().cuda.max_memory_allocated(local_index()) / 2**30, "gpu"
        except Exception:  # noqa: BLE001
            pass
    return rss_gib(), "rss"


_rss_peak = 0.0


def total_gib() -> float | None:
    """Total memory of GPU 0 in GiB (what the worker registers as its capacity); None on CPU."""
    if not cuda_available():
        return None
    try:
        return _torch().cuda.get_device_properties(local_index()).total_memory / 2**30
    except Exception:  # noqa: BLE001
        return None


def _nvml_process_gib() -> float | None:
    """GPU memory NVML charges to this process on GPU 0 (GiB: allocator + CUDA context), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            pid = os.getpid()
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(_nvml_handle(pynvml)):
                if p.pid == pid and p.usedGpuMemory is not None:
                    return p.usedGpuMemory / 2**30
            return None
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML, or a container that hides other PIDs
        return None


def reset_peak() -> None:
    """Start a job's peak measurement: torch's peak counters on CUDA, the sampled RSS peak."""
    global _rss_peak
    _rss_peak = rss_gib()
    if cuda_available():
        try:
            _torch().cuda.reset_peak_memory_stats(local_index())
        except Exception:  # noqa: BLE001
            pass


def peak_gib() -> float:
    """The job's peak so far in GiB: torch's allocator peak on CUDA, else the largest RSS sampled
    since :func:`reset_peak` (each call samples it)."""
    global _rss_peak
    if cuda_available():
        try:
            return _torch().cuda.max_memory_allocated(local_index()) / 2**30
        except Exception:  # noqa: BLE001
            pass
    _rss_peak = max(_rss_peak, rss_gib())
    return _rss_peak


def peak() -> dict[str, float | str | None]:
    """The measured peak for a job's result (``memory_peak``), GiB: ``peak_gib`` and ``kind``
    (``gpu``: torch max_memory_allocated, with ``reserved_gib`` = max_memory_reserved and
    ``nvml_gib`` = NVML's figure for this process now, which includes the CUDA context; ``rss``:
    the largest resident set size sampled on the CPU)."""
    value = peak_gib()
    if cuda_available():
        try:
            reserved = _torch().cuda.max_memory_reserved(local_index()) / 2**30
        except Exception:  # noqa: BLE001
            reserved = None
        nvml = _nvml_process_gib()
        return {"kind": "gpu", "peak_gib": round(value, 4),
                "reserved_gib": None if reserved is None else round(reserved, 4),
                "nvml_gib": None if nvml is None else round(nvml, 4), "total_gib": total_gib()}
    return {"kind": "rss", "peak_gib": round(value, 4)}
