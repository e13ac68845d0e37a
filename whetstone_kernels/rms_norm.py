"""RMSNorm forward and backward in Triton (Llama/Qwen/Mistral form and Gemma's (1 + w) form).

Maths (per row x in R^N; all arithmetic in fp32, one rounding to x.dtype on store):

    forward:  rstd = 1/sqrt(mean(x^2) + eps);  y = x * rstd * w_eff;  w_eff = w  or  1 + w (gemma)
    backward: xhat = x * rstd;  g = dy * w_eff
              dx = rstd * (g - xhat * mean(g * xhat))
              dw = sum_rows(dy * xhat)

Saved for backward: x (the input, which autograd keeps anyway), w, and rstd [M] fp32 (4 bytes a row).
Recomputed in backward: xhat. dw is reduced without atomics: the backward grid has a few programs
per SM, each walks a contiguous range of rows and writes one fp32 partial row into a [programs, N]
buffer, which torch sums (a small reduction of programs x N). When w is frozen (LoRA) the backward
runs one program per row and computes no dw at all. ``rms_norm_residual`` is the pre-norm block's
form (y, x): x's second gradient (the residual branch) is added in the backward kernel.

Shapes: x [..., N] (last dim contiguous; leading dims flattened to M rows), w [N]. Dtypes: fp32,
fp16, bf16 for x; w any float dtype (dw is returned in w's dtype). Reference: whetstone_kernels/rms_norm_ref.py.
Sources: Zhang & Sennrich 2019 (RMSNorm); HF LlamaRMSNorm / GemmaRMSNorm for the two forms.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_impl, next_pow2, num_sms, warps_for
from .launch import launch
from .rms_norm_ref import rms_norm_ref

BWD_PROGS_PER_SM = 2  # backward programs per SM when dW is needed (partial-sum rows = this x SMs)


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, N, eps, w_offset, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + w_offset
    y = x * rstd * w
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PART, DRES, stride_dy, stride_x, stride_dx, stride_dres, M, N,
                         w_offset, rows_per_prog, BLOCK_N: tl.constexpr, COMPUTE_DW: tl.constexpr,
                         HAS_DRES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + w_offset
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    for r in range(row_start, row_end):
        dy = tl.load(DY + r * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r)
        xhat = x * rstd
        g = dy * w
        c = tl.sum(g * xhat, axis=0) / N
        dx = (g - xhat * c) * rstd
        if HAS_DRES:  # the residual branch's gradient, added before the one rounding
            dx += tl.load(DRES + r * stride_dres + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + r * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw_acc += dy * xhat
    if COMPUTE_DW:
        tl.store(DW_PART + pid.to(tl.int64) * N + cols, dw_acc, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, gemma: bool = False):
    """Returns (y with x's shape and dtype, rstd [M] fp32)."""
    x2 = _rows(x)
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    block = next_pow2(n)
    if m > 0:
        launch(_rms_norm_fwd_kernel, (m,), x2, weight, y, rstd, x2.stride(0), y.stride(0), n, eps,
               1.0 if gemma else 0.0, BLOCK_N=block, num_warps=warps_for(block))
    return y.view(x.shape), rstd


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                 gemma: bool = False, need_dw: bool = True, dres: torch.Tensor | None = None):
    """Returns (dx with x's shape/dtype, dw in weight's dtype or None); ``dres`` (x's shape), when
    given, is added to dx in the kernel (fp32, one rounding)."""
    x2, dy2 = _rows(x), _rows(dy)
    dres2 = _rows(dres) if dres is not None else x2
    m, n = x2.shape
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block = next_pow2(n)
    if need_dw:  # a few programs per SM, each summing dW over a contiguous range of rows
        progs = max(1, min(m, BWD_PROGS_PER_SM * num_sms(x.device)))
        rows_per_prog = triton.cdiv(m, progs) if m else 1
        progs = triton.cdiv(m, rows_per_prog) if m else 1
        part = torch.empty((progs, n), dtype=torch.float32, device=x.device)
    else:  # frozen weight (LoRA): one program per row, no partial sums
        progs, rows_per_prog, part = m, 1, dx
    if m > 0:
        launch(_rms_norm_bwd_kernel, (progs,), dy2, x2, weight, rstd, dx, part, dres2, dy2.stride(0), x2.stride(0),
               dx.stride(0), dres2.stride(0), m, n, 1.0 if gemma else 0.0,
               rows_per_prog, BLOCK_N=block, COMPUTE_DW=need_dw,
               HAS_DRES=dres is not None, num_warps=warps_for(block))
    dw = (part.sum(0).to(weight.dtype) if m else torch.zeros_like(weight)) if need_dw else None
    return dx.view(x.shape), dw


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: saves x, w and rstd; backward recomputes xhat."""

    @staticmethod
    def forward(ctx, x, weight, eps=1e-6, gemma=False):
        y, rstd = rms_norm_fwd(x, weight, eps, gemma)
        ctx.save_for_backward(x, weight, rstd)
        ctx.gemma = gemma
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(dy, x, weight, rstd, ctx.gemma, need_dw=ctx.needs_input_grad[1])
        return dx, dw, None, None


class RMSNormResidualFunction(torch.autograd.Function):
    """(y, x) for y = rms_norm(x): the second output is x itself (a view), the residual branch of a
    pre-norm block. Backward gets both gradients and writes dx = norm_bwd(dy) + dres in one kernel
    instead of autograd adding the two [M, N] gradients in a separate pass."""

    @staticmethod
    def forward(ctx, x, weight, eps=1e-6, gemma=False):
        y, rstd = rms_norm_fwd(x, weight, eps, gemma)
        ctx.save_for_backward(x, weight, rstd)
        ctx.gemma = gemma
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, dy, dres):
        x, weight, rstd = ctx.saved_tensors
        if dy is None:
            return dres, None, None, None
        dx, dw = rms_norm_bwd(dy, x, weight, rstd, ctx.gemma, need_dw=ctx.needs_input_grad[1],
                              dres=dres)
        return dx, dw, None, None


def rms_norm_residual(x, weight, eps: float = 1e-6, gemma: bool = False, impl: str = "triton"):
    """(rms_norm(x), x) for a pre-norm block ``x + f(rms_norm(x))``: the same values as
    ``rms_norm`` and x, but x's two gradients are summed inside the norm's backward kernel (Triton).
    The reference returns x itself (autograd sums). x [..., N], weight [N]."""
    check_impl(impl)
    if impl == "reference":
        return rms_norm_ref(x, weight, eps, gemma), x
    if not torch.is_grad_enabled():  # no autograd node to build (a checkpointed forward, eval)
        return rms_norm_fwd(x, weight, eps, gemma)[0], x
    return RMSNormResidualFunction.apply(x, weight, eps, gemma)


def rms_norm(x, weight, eps: float = 1e-6, gemma: bool = False, impl: str = "triton"):
    """RMSNorm over the last dim; ``gemma=True`` scales by (1 + w). impl: "triton" | "reference"."""
    check_impl(impl)
    if impl == "reference":
        return rms_norm_ref(x, weight, eps, gemma)
    if not torch.is_grad_enabled():
        return rms_norm_fwd(x, weight, eps, gemma)[0]
    return RMSNormFunction.apply(x, weight, eps, gemma)
