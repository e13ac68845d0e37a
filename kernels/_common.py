"""Small helpers shared by the kernel modules (torch + triton only)."""
from __future__ import annotations

import os

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def num_sms(device: torch.device) -> int:
    """Number of streaming multiprocessors (a small constant on CPU/interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


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
    return triton.next_power_of_2(max(int(n), 1))


def check_impl(impl: str) -> None:
    if impl not in ("triton", "reference"):
        raise ValueError(f"impl must be 'triton' or 'reference', got {impl!r}")
