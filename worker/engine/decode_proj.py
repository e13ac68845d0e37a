"""One projection of the engine's decoder (worker.engine.decode), resolved once per generate call.

:class:`DecodeProj` computes y = x W^T (+ b) + s (x A^T) B^T for x [..., in] in the compute dtype,
with the PEFT adapter's A [r, in], B [out, r] (active adapter only; None when disabled or absent).
A base held as NF4 is multiplied by ``whetstone_kernels.nf4_matmul`` (W dequantised in registers) when x has
fewer than :data:`SMALL_M` rows, the kernel is available on CUDA and :func:`fused_ok` found it
right and faster for that weight shape on this GPU (the bias and the LoRA term, s (x A^T) B^T, are
then added in the kernel's epilogue); otherwise W is dequantised (or read dense from gencache's copy) and
multiplied by a GEMM. x A^T of a few rows is one ``whetstone_kernels.skinny_matmul`` launch on CUDA
(:func:`lora_xa`). A kernel that raises on a shape falls back (to dequantise + GEMM, or a GEMM) and logs it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("worker.engine.decode")

#: Rows below which an NF4 projection uses the fused NF4 matmul instead of dequantise + GEMM.
SMALL_M = 64


def nf4_matmul_kernel():
    try:
        from whetstone_kernels.nf4_matmul import nf4_matmul
    except ImportError:
        return None
    return nf4_matmul


def skinny_matmul_kernel():
    """``whetstone_kernels.skinny_matmul`` (x A^T in one launch for few rows), or None without it."""
    try:
        from whetstone_kernels.skinny_matmul import skinny_matmul
    except ImportError:
        return None
    return skinny_matmul


_SKINNY_FAILED: list = []  # a skinny_matmul that raised once is not tried again in this process


def lora_xa(x2: torch.Tensor, A: torch.Tensor, skinny) -> torch.Tensor:
    """x2 [rows, in] @ A^T for A [r, in] (one adapter's A, or several stacked): ``skinny``
    (:func:`skinny_matmul_kernel`, one launch; None: not on CUDA or not the Triton engine) when
    rows < :data:`SMALL_M`, else a GEMM (cuBLAS runs these as a split-K GEMM plus a reduction)."""
    A = A.to(x2.dtype)
    if skinny is not None and x2.shape[0] < SMALL_M and not _SKINNY_FAILED:
        try:
            return skinny(x2, A)
        except Exception as e:  # noqa: BLE001 (a kernel that cannot run here: the GEMM is right too)
            log.warning("decode: skinny_matmul failed (%s); x A^T by GEMM from now on", e)
            _SKINNY_FAILED.append(str(e))
    return x2 @ A.t()


@dataclass
class DecodeProj:
    """One projection resolved for a generate call: base (NF4Linear or Linear), bias, LoRA."""

    base: torch.nn.Module
    bias: torch.Tensor | None
    A: torch.Tensor | None
    B: torch.Tensor | None
    scale: float
    state: object = None  # NF4State for the fused NF4 matmul
    skinny: object = None  # skinny_matmul for x A^T (None: a GEMM)

    def __call__(self, x: torch.Tensor, fused, xa: torch.Tensor | None = None) -> torch.Tensor:
        """y [..., out] for x [..., in]; ``xa`` [rows, r]: x A^T when the caller computed it
        (one GEMM for the projections that share x, see :func:`shared_lora_a`)."""
        from worker.engine.quant import dense_weight

        x2 = x.reshape(-1, x.shape[-1])
        if self.state is not None and fused is not None and x2.shape[0] < SMALL_M \
                and getattr(self.base, "_dense", None) is None:
            lora = None
            if self.A is not None:  # the B term goes into the kernel's epilogue: no GEMM + add of its own
                xa = lora_xa(x2, self.A, self.skinny) if xa is None else xa
                lora = (xa, self.B.to(x2.dtype), self.scale)
            bias = self.bias.to(x2.dtype) if self.bias is not None else None
            try:
                y = fused(x2, self.base.packed, self.state, bias, lora=lora)
            except Exception as e:  # noqa: BLE001 (a kernel that cannot run this shape)
                log.warning("decode: NF4 matmul failed (%s); dequantising this weight instead", e)
                self.state = None
                return self(x, fused, xa)
            return y.view(*x.shape[:-1], y.shape[-1])
        y = x2 @ dense_weight(self.base, x2.dtype).t()
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        if self.A is not None:
            xa = lora_xa(x2, self.A, self.skinny) if xa is None else xa
            y.addmm_(xa, self.B.to(x2.dtype).t(), alpha=self.scale)
        return y.view(*x.shape[:-1], y.shape[-1])


CHECKED: dict = {}


def cuda_seconds(fn, reps: int = 5, backlog_cycles: int = 4_000_000) -> float:
    """GPU seconds of one ``fn()`` on the current CUDA stream, as a CUDA-graph replay sees it: one
    warm-up call, then a spin kernel of ``backlog_cycles`` GPU clocks (~2 ms) is queued ahead of
    the timed calls, so the host enqueues them while the GPU is busy and their Python/launch time
    (which the decoder's graph removes, and which is larger for the fused wrapper than for
    dequantise + GEMM) is not counted. Mean of ``reps`` back-to-back calls between two events."""
    fn()
    spin = getattr(torch.cuda, "_sleep", None)  # private but long-standing; without it, no backlog
    if spin is not None:
        spin(backlog_cycles)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def fused_ok(fused, lin, dtype, rows: int = 8, timer=None) -> bool:
    """Whether decoding should use ``fused`` (the NF4 matmul) for this projection's weight shape:
    it runs the shape, agrees with dequantise + GEMM (random x [rows, K] in ``dtype``; relative
    error under 2e-2 for 16-bit, 1e-4 for fp32) and, on CUDA, is faster than dequantise + GEMM
    (``timer(fn)`` seconds, :func:`cuda_seconds` by default; no timing off CUDA unless a timer is
    given). Decided once per (device, N, K, dtype) and process; a refusal or a mismatch is logged.
    Either way the tokens are right: the choice costs speed at worst, never correctness."""
    from worker.engine.quant import dense_weight

    base = lin.base
    key = (str(base.packed.device), (base.out_features, base.in_features), dtype)
    if key not in CHECKED:
        W = dense_weight(base, dtype)
        g = torch.Generator(device=W.device).manual_seed(0)
        x = torch.randn(rows, W.shape[1], generator=g, device=W.device).to(dtype)
        try:
            got = fused(x, base.packed, lin.state).float()
        except Exception as e:  # noqa: BLE001
            log.warning("decode: NF4 matmul cannot run %s (%s); dequantising it", key, e)
            got = None
        want = (x @ W.t()).float()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        ok = got is not None and bool(((got - want).norm() <= tol * want.norm()).item())
        if got is not None and not ok:
            log.warning("decode: NF4 matmul disagrees with dequantise + GEMM on %s; "
                        "dequantising it", key)
        timer = timer or (cuda_seconds if W.is_cuda else None)
        if ok and timer is not None:
            t_fused = timer(lambda: fused(x, base.packed, lin.state))
            t_dense = timer(lambda: x @ dense_weight(base, dtype).t())
            ok = t_fused < t_dense
            log.info("decode: %s NF4 matmul %.3f ms, dequantise + GEMM %.3f ms: using %s", key,
                     t_fused * 1e3, t_dense * 1e3, "the NF4 matmul" if ok else "dequantise + GEMM")
        CHECKED[key] = ok
    return CHECKED[key]


def decode_proj(module, impl: str, on_cuda: bool, dtype: torch.dtype | None = None) -> DecodeProj:
    """The :class:`DecodeProj` of a (PEFT LoRA) linear ``module``. With ``dtype`` (the compute
    dtype) the adapter's A, B and the bias are cast once here, not at every token (the weights do
    not change during a generate call). Raises ValueError for a LoRA variant the fused path
    cannot run (see ``lora_ops.lora_params``)."""
    from worker.engine.lora_ops import lora_params
    from worker.engine.quant import NF4Linear

    lp = lora_params(module)
    base = getattr(module, "base_layer", module)
    A, B, s = lp if lp is not None else (None, None, 0.0)
    bias = getattr(base, "bias", None)
    if dtype is not None:
        A, B = (t.detach().to(dtype) if t is not None else None for t in (A, B))
        bias = bias.detach().to(dtype) if bias is not None else None
    state = base.state() if isinstance(base, NF4Linear) and impl == "triton" and on_cuda else None
    skinny = skinny_matmul_kernel() if A is not None and impl == "triton" and on_cuda else None
    return DecodeProj(base, bias, A, B, s, state, skinny)


def shared_lora_a(projs) -> torch.Tensor | None:
    """[sum r, in]: the A matrices of ``projs`` (DecodeProjs that read the same x: q, k, v; or
    gate, up) stacked, so x A^T for all of them is one GEMM; None unless every one has an adapter
    with A in one dtype. Split the product with :func:`split_lora_a`."""
    As = [p.A for p in projs]
    if any(a is None for a in As) or len({a.dtype for a in As}) != 1:
        return None
    return torch.cat(As, 0)


def split_lora_a(xa: torch.Tensor | None, projs) -> list:
    """The column blocks of ``xa`` = x [shared_lora_a]^T, one per projection (None: no sharing)."""
    if xa is None:
        return [None] * len(projs)
    return list(torch.split(xa, [p.A.shape[0] for p in projs], dim=1))
