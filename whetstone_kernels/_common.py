"""Small helpers shared by the kernel modules (torch + triton only)."""
from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


_SMS: dict = {}


def num_sms(device: torch.device) -> int:
    """Number of streaming multiprocessors (a small constant on CPU/interpreter); cached per device."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def tile_counters(store: dict, device, n: int, least: int) -> torch.Tensor:
    """An int32 buffer of at least ``n`` (and ``least``) zeros on ``device``, kept in ``store``
    (one per kernel module and device): the per-tile counters of a split-K "last program
    reduces" kernel, which sets each back to 0 when it is done, so they are zero between calls
    (calls on one device ordered on one stream). Grown, never shrunk."""
    buf = store.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, least), dtype=torch.int32, device=device)
        store[device] = buf
    return buf


def warps_for(block: int) -> int:
    """num_warps for a row kernel that holds `block` elements per program."""
    if block >= 16384:
        return 16
    if block >= 4096:
        return 8
    if block >= 1024:
        return 4
    return 2


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (plain Python: triton.next_power_of_2 costs microseconds a call)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def check_impl(impl: str) -> None:
    if impl not in ("triton", "reference"):
        raise ValueError(f"impl must be 'triton' or 'reference', got {impl!r}")
