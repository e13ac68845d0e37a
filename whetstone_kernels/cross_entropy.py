"""Cross-entropy fused with the LM head, chunked over tokens, in Triton + cuBLAS; forward and backward.

Maths (see whetstone_kernels/cross_entropy_ref.py): z = h W^T, optional soft-cap z <- c tanh(z/c),
loss = sum_t [lse(z_t) - z_t[y_t]] / n over tokens with y_t != ignore_index; n = #valid ("mean") or an
external normaliser ("sum"). Gradient of the logits: dz = (softmax(z) - onehot(y)) * (1 - tanh^2) / n.

How: tokens are processed in chunks of C rows (C * V * sizeof(dtype) <= ``chunk_bytes``, 512 MiB by
default: 2048 rows at vocab 128256 in bf16), so the full [T, V] logits never exist:

    for each chunk:  z = h_c W^T (cuBLAS, h's dtype) -> Triton row kernel: online max / sum-exp over V
                     in fp32, loss per row, then overwrites z in place with dz (scaled by 1/n)
                     -> dh_c = dz W (written into the [T, H] gradient), dW += dz^T h_c (if W needs grad).

The gradients are computed during the forward (one pass over the logits; nothing is recomputed), saved
(dh [T, H] in h's dtype, dW in W's dtype when asked) and scaled by the incoming grad in backward. 1/n
is a device scalar (no host synchronisation). Extra memory: one chunk of logits, dh, and dW if asked.
Shapes: hidden [..., H] (flattened to T rows), weight [V, H], labels [...] int64 aligned with hidden
(shift them first for causal LM). Dtypes fp32/fp16/bf16 (logits in h's dtype, as HF computes them).
Sources: Liger-Kernel / Apple "cut cross-entropy" for the chunked fused idea; Gemma 2 for soft-capping.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_impl
from .cross_entropy_ref import linear_cross_entropy_ref
from .launch import launch

_BLOCK_V = 4096


@triton.jit
def _ce_rows_kernel(Z, stride_z, LABELS, LOSS, SCALE, V, ignore_index, softcap,
                    HAS_SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    zp = Z + row * stride_z
    label = tl.load(LABELS + row).to(tl.int64)
    valid = label != ignore_index
    cols0 = tl.arange(0, BLOCK_V)
    m = tl.full([], -float("inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + cols0
        z = tl.load(zp + cols, mask=cols < V, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * (2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0)
        z = tl.where(cols < V, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    safe = tl.where(valid, label, 0)
    zt = tl.load(zp + safe).to(tl.float32)
    if HAS_SOFTCAP:
        zt = softcap * (2.0 * tl.sigmoid(2.0 * zt / softcap) - 1.0)
    tl.store(LOSS + row, tl.where(valid, lse - zt, 0.0))
    if WRITE_GRAD:
        scale = tl.load(SCALE) * tl.where(valid, 1.0, 0.0)
        for start in range(0, V, BLOCK_V):
            cols = start + cols0
            mask = cols < V
            z = tl.load(zp + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = 2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0
                z = softcap * t
            g = tl.exp(z - lse) - tl.where(cols == label, 1.0, 0.0)
            if HAS_SOFTCAP:
                g = g * (1.0 - t * t)
            tl.store(zp + cols, (g * scale).to(Z.dtype.element_ty), mask=mask)


def _scale(labels, ignore_index, reduction, normaliser, device):
    if reduction == "mean":
        return 1.0 / (labels != ignore_index).sum().clamp_min(1).to(torch.float32).reshape(1)
    if reduction == "sum":
        if normaliser is None:
            return torch.ones(1, dtype=torch.float32, device=device)
        return 1.0 / torch.as_tensor(normaliser, dtype=torch.float32, device=device).reshape(1)
    raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


def linear_cross_entropy_fwd(hidden, weight, labels, ignore_index=-100, softcap=None, reduction="mean",
                             normaliser=None, need_dh=True, need_dw=False, chunk_bytes=512 << 20):
    """Returns (loss fp32 scalar, dh [T, H] or None, dW [V, H] or None); dh/dW are d loss / d input."""
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.stride(-1) != 1:
        h = h.contiguous()
    y = labels.reshape(-1)
    t, v = h.shape[0], weight.shape[0]
    if y.numel() != t:
        raise ValueError(f"labels ({y.numel()}) must match the hidden rows ({t})")
    scale = _scale(y, ignore_index, reduction, normaliser, h.device)
    loss_rows = torch.empty(t, dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if need_dh else None
    dw = torch.zeros_like(weight) if need_dw else None
    grad = need_dh or need_dw
    chunk = max(1, min(t, chunk_bytes // max(1, v * h.element_size())))
    for c0 in range(0, t, chunk):
        c1 = min(t, c0 + chunk)
        hc = h[c0:c1]
        z = hc @ weight.t()
        launch(_ce_rows_kernel, (c1 - c0,), z, z.stride(0), y[c0:c1], loss_rows[c0:c1], scale, v,
               ignore_index, float(softcap or 0.0), HAS_SOFTCAP=bool(softcap), WRITE_GRAD=grad,
               BLOCK_V=_BLOCK_V, num_warps=8)
        if need_dh:
            torch.mm(z, weight, out=dh[c0:c1])
        if need_dw:
            dw.addmm_(z.t(), hc)
        del z
    loss = loss_rows.sum() * scale[0]
    return loss, (dh.view(hidden.shape) if need_dh else None), dw


def linear_cross_entropy_bwd(grad_loss, dh, dw):
    """Scale the gradients computed in the forward by d(outer)/d(loss)."""
    dh = dh * grad_loss.to(dh.dtype) if dh is not None else None
    dw = dw * grad_loss.to(dw.dtype) if dw is not None else None
    return dh, dw


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Computes the loss and its gradients in forward (chunked); saves dh (and dW), not the logits."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, softcap, reduction, normaliser, chunk_bytes):
        loss, dh, dw = linear_cross_entropy_fwd(hidden, weight, labels, ignore_index, softcap, reduction, normaliser,
                                                need_dh=ctx.needs_input_grad[0], need_dw=ctx.needs_input_grad[1],
                                                chunk_bytes=chunk_bytes)
        ctx.save_for_backward(*(x for x in (dh, dw) if x is not None))
        ctx.has = (dh is not None, dw is not None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        saved = list(ctx.saved_tensors)
        dh = saved.pop(0) if ctx.has[0] else None
        dw = saved.pop(0) if ctx.has[1] else None
        dh, dw = linear_cross_entropy_bwd(grad_loss, dh, dw)
        return dh, dw, None, None, None, None, None, None


def linear_cross_entropy(hidden, weight, labels, ignore_index: int = -100, softcap: float | None = None,
                         reduction: str = "mean", normaliser=None, chunk_bytes: int = 512 << 20,
                         impl: str = "triton"):
    """Fused LM head + cross-entropy loss (fp32 scalar). Gradients for hidden and, if it requires grad,
    the head weight. ``normaliser`` (float or tensor) divides the summed loss when reduction="sum"."""
    check_impl(impl)
    if impl == "reference":
        return linear_cross_entropy_ref(hidden, weight, labels, ignore_index, softcap, reduction, normaliser)
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        # evaluation: the loss only, no gradient written into the logits chunks
        return linear_cross_entropy_fwd(hidden, weight, labels, ignore_index, softcap, reduction, normaliser,
                                        need_dh=False, need_dw=False, chunk_bytes=chunk_bytes)[0]
    return LinearCrossEntropyFunction.apply(hidden, weight, labels, ignore_index, softcap, reduction, normaliser,
                                            chunk_bytes)
