"""Fused LoRA linear autograd functions with hand-written backward (frozen base, trainable A, B).

For one projection with frozen base W [out, in] (dense, or NF4 dequantised on the fly), frozen bias
b, LoRA A [r, in], B [out, r] and scale s (alpha/r, or alpha/sqrt(r) with rsLoRA), on X [T, in]:

    forward:   XA = X A^T [T, r];   Y = X W^T + b + s XA B^T
    backward:  dYB = dY B [T, r]
               dX += dY W + s dYB A          dA = s dYB^T X          dB = s dY^T XA

:class:`LoRAProjFunction` runs N projections that read the same X (q, k, v together; gate and up;
o alone): one pass over X, N base matmuls, N LoRA paths, and one dX accumulated in place.
Saved: X (once) and each XA [T, r]; W is re-dequantised in backward, never saved or stored dense.

:class:`LoRAMLPFunction` is the whole gated MLP, Y = down(act(gate(X)) * up(X)) with act silu
(SwiGLU) or gelu / gelu_tanh (GeGLU):

    forward:   G, U as above;  H = act(G) U (kernels.swiglu);  Y = H Wd^T + s (H Ad^T) Bd^T
    backward:  dH = dY Wd + s (dY Bd) Ad;  H recomputed from G, U for dAd;  dG, dU = glu_bwd(dH, G, U)
               then the gate and up projections' backward as above (dX summed).
Saved: X, G, U [T, I], XAg, XAu, HAd [T, r]; H is recomputed, not saved.

``need_y`` False (a checkpointed layer's recompute, where the MLP output only feeds the discarded
layer output ``h + m``: :func:`~worker.engine.patch.run_layer`) skips the down projection: no Wd
dequant, no H Wd^T [T, I] x [I, H] matmul (~27 % of a Llama layer's linear FLOPs), no bias/LoRA-B
add; HAd = H Ad^T [T, r] (what dBd needs) is still computed and saved, H only when Ad exists. Y is
then ``torch.empty`` [..., out] in X's dtype: uninitialised, never read. Backward is unchanged.

Dtypes: the compute dtype is X's (bf16 on GPU, fp32 in tests); A, B (fp32 master weights or X's
dtype) are cast to it, and dA, dB come back in A's / B's dtype. Only dX, dA, dB are computed: the base
weight and bias are frozen. ``impl`` picks the NF4 dequant and GLU kernels ("triton" | "reference");
the matmuls are torch's either way. Shapes: X [..., in] is flattened to T rows; outputs keep X's
leading dims.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(eq=False)
class Proj:
    """One projection: its frozen base module, optional frozen bias, and the LoRA scale.

    ``has_lora`` False means a frozen projection (no LoRA on it); then no A, B tensors are passed.
    """

    base: nn.Module
    bias: torch.Tensor | None
    scale: float
    has_lora: bool

    def weight(self, dtype) -> torch.Tensor:
        from worker.engine.quant import dense_weight

        return dense_weight(self.base, dtype)


def _flat(x):
    return x.reshape(-1, x.shape[-1])


def _proj_fwd(X, p: Proj, A, B):
    """Y = X W^T + b + s (X A^T) B^T; returns (Y, XA or None)."""
    W = p.weight(X.dtype)
    Y = X @ W.t()
    del W
    if p.bias is not None:
        Y += p.bias.to(Y.dtype)
    XA = None
    if p.has_lora:
        XA = _xa(X, A)
        Y.addmm_(XA, B.to(X.dtype).t(), alpha=p.scale)
    return Y, XA


def _xa(X, A):
    """X A^T [T, r] in X's dtype."""
    return X @ A.to(X.dtype).t()


def _proj_bwd(dY, X, XA, p: Proj, A, B, dX):
    """Accumulates dY W (+ s dY B A) into dX (or creates it); returns (dX, dA, dB)."""
    W = p.weight(dY.dtype)
    if dX is None:
        dX = dY @ W
    else:
        dX.addmm_(dY, W)
    del W
    dA = dB = None
    if p.has_lora:
        Ac, Bc = A.to(dY.dtype), B.to(dY.dtype)
        dYB = dY @ Bc
        dX.addmm_(dYB, Ac, alpha=p.scale)
        dA = (dYB.t() @ X).mul_(p.scale).to(A.dtype)
        dB = (dY.t() @ XA).mul_(p.scale).to(B.dtype)
    return dX, dA, dB


def _split_ab(projs, ab):
    out, i = [], 0
    for p in projs:
        if p.has_lora:
            out.append((ab[i], ab[i + 1]))
            i += 2
        else:
            out.append((None, None))
    return out


def _grads(projs, grads):
    res = []
    for p, (dA, dB) in zip(projs, grads):
        if p.has_lora:
            res += [dA, dB]
    return res


class LoRAProjFunction(torch.autograd.Function):
    """N LoRA projections of one input: forward(X, projs, *A_B) -> tuple of N outputs."""

    @staticmethod
    def forward(ctx, X, projs, *ab):
        X2 = _flat(X)
        pairs = _split_ab(projs, ab)
        outs, xas = [], []
        for p, (A, B) in zip(projs, pairs):
            Y, XA = _proj_fwd(X2, p, A, B)
            outs.append(Y.view(*X.shape[:-1], Y.shape[-1]))
            xas.append(XA)
        ctx.projs, ctx.xshape = projs, X.shape
        ctx.has_xa = [xa is not None for xa in xas]
        ctx.save_for_backward(X2, *[xa for xa in xas if xa is not None], *ab)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        projs = ctx.projs
        saved = list(ctx.saved_tensors)
        X2 = saved.pop(0)
        nxa = sum(ctx.has_xa)
        xas_it = iter(saved[:nxa])
        xas = [next(xas_it) if h else None for h in ctx.has_xa]
        pairs = _split_ab(projs, saved[nxa:])
        dX, grads = None, []
        for p, (A, B), XA, dy in zip(projs, pairs, xas, dys):
            if dy is None:
                dy = torch.zeros(*ctx.xshape[:-1], p.base.out_features, dtype=X2.dtype,
                                 device=X2.device)
            dX, dA, dB = _proj_bwd(_flat(dy).to(X2.dtype), X2, XA, p, A, B, dX)
            grads.append((dA, dB))
        return (dX.view(ctx.xshape), None, *_grads(projs, grads))


def _glu(impl):
    if impl == "triton":
        from kernels.swiglu import glu_bwd, glu_fwd

        return glu_fwd, lambda dh, g, u, act: glu_bwd(dh, g, u, act, inplace=True)
    from kernels.swiglu_ref import glu_ref, glu_ref_bwd

    return glu_ref, glu_ref_bwd


class LoRAMLPFunction(torch.autograd.Function):
    """forward(X, (gate, up, down), activation, impl, need_y, *A_B) -> Y (gated MLP with LoRA on
    each); ``need_y`` False: Y is left uninitialised (see the module docstring)."""

    @staticmethod
    def forward(ctx, X, projs, activation, impl, need_y, *ab):
        X2 = _flat(X)
        pg, pu, pd = projs
        (Ag, Bg), (Au, Bu), (Ad, Bd) = _split_ab(projs, ab)
        G, XAg = _proj_fwd(X2, pg, Ag, Bg)
        U, XAu = _proj_fwd(X2, pu, Au, Bu)
        fwd, _ = _glu(impl)
        if need_y:
            H = fwd(G, U, activation)
            Y, HAd = _proj_fwd(H, pd, Ad, Bd)
        else:  # recompute: Y's value is never read; only HAd (for dBd) is
            H = fwd(G, U, activation) if pd.has_lora else None
            HAd = _xa(H, Ad) if pd.has_lora else None
            Y = X2.new_empty(X2.shape[0], pd.base.out_features)
        del H
        ctx.projs, ctx.activation, ctx.impl, ctx.xshape = projs, activation, impl, X.shape
        small = [t for t in (XAg, XAu, HAd) if t is not None]
        ctx.has = [t is not None for t in (XAg, XAu, HAd)]
        ctx.save_for_backward(X2, G, U, *small, *ab)
        return Y.view(*X.shape[:-1], Y.shape[-1])

    @staticmethod
    def backward(ctx, dY):
        pg, pu, pd = ctx.projs
        saved = list(ctx.saved_tensors)
        X2, G, U = saved[:3]
        rest = saved[3:]
        n = sum(ctx.has)
        it = iter(rest[:n])
        XAg, XAu, HAd = (next(it) if h else None for h in ctx.has)
        (Ag, Bg), (Au, Bu), (Ad, Bd) = _split_ab(ctx.projs, rest[n:])
        fwd, bwd = _glu(ctx.impl)
        dY = _flat(dY).to(X2.dtype)
        H = fwd(G, U, ctx.activation) if pd.has_lora else None
        dH, dAd, dBd = _proj_bwd(dY, H, HAd, pd, Ad, Bd, None)
        del H
        dG, dU = bwd(dH, G, U, ctx.activation)
        del dH
        dX, dAg, dBg = _proj_bwd(dG, X2, XAg, pg, Ag, Bg, None)
        dX, dAu, dBu = _proj_bwd(dU, X2, XAu, pu, Au, Bu, dX)
        grads = _grads(ctx.projs, [(dAg, dBg), (dAu, dBu), (dAd, dBd)])
        return (dX.view(ctx.xshape), None, None, None, None, *grads)


def lora_params(module: nn.Module):
    """(A weight, B weight, scale) of the active PEFT adapter of ``module``, or None.

    None when the module has no LoRA, or when its adapters are disabled (``disable_adapter()``:
    GRPO's reference pass), so the projection runs as its frozen base alone, as PEFT does then.
    Raises ValueError when it has a variant the fused path cannot run (dropout > 0, DoRA, several
    active adapters, merged).
    """
    if not hasattr(module, "lora_A") or getattr(module, "disable_adapters", False):
        return None
    active = list(getattr(module, "active_adapters", ["default"]))
    if len(active) != 1 or getattr(module, "merged", False):
        raise ValueError("several active adapters or merged adapters")
    name = active[0]
    if name not in module.lora_A:
        return None
    if name in getattr(module, "lora_variant", {}):
        raise ValueError("a LoRA variant (DoRA, ...) is not fused")
    drop = module.lora_dropout[name]
    if isinstance(drop, nn.Dropout) and drop.p > 0:
        raise ValueError("lora_dropout > 0 is not fused")
    return module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name])


def make_proj(module: nn.Module):
    """(Proj, [A, B] or []) for a PEFT LoRA linear or a plain frozen linear."""
    lp = lora_params(module)
    base = getattr(module, "base_layer", module)
    bias = getattr(base, "bias", None)
    if lp is None:
        return Proj(base, bias, 0.0, False), []
    A, B, s = lp
    return Proj(base, bias, s, True), [A, B]
