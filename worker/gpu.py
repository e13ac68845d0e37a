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


def device_name() -> str:
    """A human-readable device label, e.g. ``cuda:0 NVIDIA H200`` or ``cpu (16 cores)``."""
    if cuda_available():
        torch = _torch()
        try:
            return f"cuda:0 {torch.cuda.get_device_name(0)}"
        except Exception:  # noqa: BLE001
            return "cuda:0"
    return f"cpu ({os.cpu_count() or 1} cores, {platform.machine()})"


def _nvml_used_gib() -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
            handle = (pynvml.nvmlDeviceGetHandleByIndex(int(visible)) if visible.isdigit()
                      else pynvml.nvmlDeviceGetHandleByUUID(visible))
            return pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
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
            return torch.cuda.memory_reserved(0) / 2**30, "gpu"
        except Exception:  # noqa: BLE001
            used = _nvml_used_gib()
            if used is not None:
                return used, "gpu"
    return rss_gib(), "rss"


def peak_memory_gib() -> tuple[float, str]:
    """Peak GPU memory allocated by torch when CUDA is present, else current RSS."""
    if cuda_available():
        try:
            return _torch().cuda.max_memory_allocated(0) / 2**30, "gpu"
        except Exception:  # noqa: BLE001
            pass
    return rss_gib(), "rss"
