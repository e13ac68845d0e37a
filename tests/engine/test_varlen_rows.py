"""Packed rows for the FlashAttention varlen path (worker/engine/varlen.py), on the CPU: the row
offsets found from position_ids, and the fallback mask they give, which must be the dense route's
own mask (build_mask) for every packed batch. The kernel itself runs only on CUDA
(tests/gpu/test_attention_gpu.py)."""
import pytest
import torch

from worker.engine import varlen
from worker.engine.attention import build_mask, mask_kind


def _positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in rows])


@pytest.mark.parametrize("rows", [[[5, 3, 8]], [[7, 9], [1, 15]], [[16]], [[1] * 6],
                                  [[2, 30, 1], [10, 10, 13]]])
def test_segments_and_their_mask(rows):
    pos = _positions(rows)
    B, S = pos.shape
    seg = varlen.segments(pos)
    starts, off = [], 0
    for lens in rows:
        for n in lens:
            starts.append(off)
            off += n
    assert seg.cu_seqlens.dtype == torch.int32
    assert seg.cu_seqlens.tolist() == starts + [B * S]
    assert seg.max_len == max(n for lens in rows for n in lens)
    kind = mask_kind(pos, None, S)
    if kind[0]:
        assert torch.equal(varlen.dense_mask(seg, B, S), build_mask(pos, None, S, None, "cpu", kind))


def test_a_plain_batch_is_one_row_per_batch_row():
    pos = torch.arange(12).expand(3, 12)
    seg = varlen.segments(pos)
    assert seg.cu_seqlens.tolist() == [0, 12, 24, 36] and seg.max_len == 12


def test_not_usable_off_cuda_or_with_softcap_or_window():
    q = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)
    assert not varlen.usable(q, None, None)  # CPU tensors never take the kernel
