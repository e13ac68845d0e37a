"""worker.engine.quant.NF4Linear and its bound dequantisers (whetstone_kernels.nf4.nf4_dequantizer;
their bits and re-binding on the GPU: tests/gpu/test_launch_gpu.py)."""
from __future__ import annotations

import torch


def test_nf4_linear_forgets_its_bound_dequantisers_when_moved():
    """NF4Linear._apply (.to(), .cuda(), ...) drops the dequantisers bound to its old buffers
    (on CUDA each holds them: keeping it would keep the old GPU memory alive)."""
    from whetstone_kernels.nf4_ref import nf4_quantize_ref
    from worker.engine.quant import NF4Linear

    packed, st = nf4_quantize_ref(torch.randn(64, 128))
    lin = NF4Linear(packed, st.absmax, st.shape, torch.float32, offset=st.offset,
                    absmax2=st.absmax2, code2=st.code2)
    lin._dequantizers[torch.bfloat16] = ((lin.packed,), lambda: None)
    lin.to(torch.device("cpu"))
    assert lin._dequantizers == {}
    assert torch.equal(lin.dequant(), NF4Linear(packed, st.absmax, st.shape, torch.float32,
                                                offset=st.offset, absmax2=st.absmax2,
                                                code2=st.code2).dequant())
