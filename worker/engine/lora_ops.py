"""Fused LoRA linear autograd functions with hand-written backward (frozen base, trainable A, B).

For one projection with frozen base W [out, in] (dense, or NF4 dequantised on the fly), frozen bias
b, LoRA A [r, in], B [out, r] and scale s (alpha/r, or alpha/sqrt(r) with rsLoRA), on X [T, in]:

    forward:   XA = X A^T [T, r];   Y = X W^T + b + s XA B^T
    backward:  dYB = dY B [T, r]
               dX += dY W + s dYB A          dA = s dYB^T X          dB = s dY^T XA

:class:`LoRAProjFunction` runs N projections that read the same X (q, k, v together; gate and up;
o alone). In the order the GPU does it (:func:`_group_fwd`, :func:`_group_bwd`):

    XAs = X [A_1; ...; A_N]^T [T, sum r], each r-column block scaled by its s (one GEMM, one pass
          over X);  Y_p = XAs_p B_p^T (small-K GEMM, writes Y_p), then Y_p += X W_p^T in the base
          GEMM's epilogue (beta 1): Y is written once, never re-read for the LoRA add
    dYBs_p = s dY_p B_p;  dX = [dYBs_1 ... dYBs_N] [A_1; ...; A_N] (one GEMM writes dX), then
          dX += dY_p W_p per projection (epilogue adds);  dA = [dYBs]^T X (one pass over X, split
          by rows);  dB_p = dY_p^T XAs_p
Saved: X (once) and XAs [T, sum r]; W is re-dequantised in backward, never saved or stored dense.

:class:`LoRAMLPFunction` is the whole gated MLP, Y = down(act(gate(X)) * up(X)) with act silu
(SwiGLU) or gelu / gelu_tanh (GeGLU):

    forward:   G, U as one group of X;  H = act(G) U (kernels.swiglu);  Y = down group of H
    backward:  dH = down group's dX;  H recomputed from G, U for dAd;  dG, dU = glu_bwd(dH, G, U)
               then the gate/up group's backward (one dX).
Saved: X, G, U [T, I], XAs of gate/up [T, 2r], HAs of down [T, r]; H is recomputed, not saved.

``need_y`` False (a checkpointed layer's recompute, where an output only feeds a value that is
discarded or replaced: :func:`~worker.engine.patch.run_layer`) skips the base projections: for the
MLP no Wd dequant and no H Wd^T [T, I] x [I, H] matmul (~27 % of a Llama layer's linear FLOPs); for
:class:`LoRAProjFunction` no base at all. XAs (what dB needs) is still computed and saved, and the
outputs are ``torch.empty`` in X's dtype: uninitialised, never read. Backward is unchanged.

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


def _group_fwd(X, projs, pairs, need_y=True):
    """Y_p = X W_p^T + b_p + XAs_p B_p^T for the projections of one input X [T, in].

    XAs = X [A_1; A_2; ...]^T, scaled per projection (s_p XA_p), is one GEMM for the group
    [T, sum r] and is what backward keeps. Each LoRA term is written first (a small-K GEMM) and the
    base GEMM adds onto it in its epilogue (addmm_, beta 1), so Y is written once and never re-read
    for the LoRA add. ``need_y`` False skips the base (no dequant, no GEMM): Y uninitialised.
    Returns ([Y_p], XAs or None, [r_p]).
    """
    As = [A.to(X.dtype) for p, (A, _) in zip(projs, pairs) if p.has_lora]
    ranks = [A.shape[0] for A in As]
    XAs = None
    if As:
        XAs = X @ (torch.cat(As) if len(As) > 1 else As[0]).t()
        scales = [p.scale for p in projs if p.has_lora]
        if len(set(scales)) == 1:
            if scales[0] != 1.0:
                XAs.mul_(scales[0])
        else:
            for xa, sc in zip(XAs.split(ranks, dim=1), scales):
                xa.mul_(sc)
    xas = iter(XAs.split(ranks, dim=1)) if XAs is not None else iter(())
    outs = []
    for p, (_, B) in zip(projs, pairs):
        xa = next(xas) if p.has_lora else None
        if not need_y:
            outs.append(X.new_empty(X.shape[0], p.base.out_features))
            continue
        W = p.weight(X.dtype)
        if xa is not None:
            Y = xa @ B.to(X.dtype).t()
            Y.addmm_(X, W.t())
        else:
            Y = X @ W.t()
        del W
        if p.bias is not None:
            Y += p.bias.to(Y.dtype)
        outs.append(Y)
    return outs, XAs, ranks


def _group_bwd(dys, X, XAs, ranks, projs, pairs):
    """dX = sum_p dY_p W_p + s_p dY_p B_p A_p, and each (dA_p, dB_p); dys [T, out_p] in X's dtype.

    dYBs_p = s_p dY_p B_p [T, r_p] are concatenated, so the LoRA part of dX is one GEMM
    [T, sum r] x [sum r, in] that writes dX, and dA for the whole group is one pass over X; every
    base dY_p W_p then adds onto dX in the GEMM epilogue.
    """
    dybs, As = [], []
    xas = iter(XAs.split(ranks, dim=1)) if XAs is not None else iter(())
    grads = []
    for p, (A, B), dy in zip(projs, pairs, dys):
        if not p.has_lora:
            grads.append((None, None))
            continue
        xa = next(xas)
        dyb = dy @ B.to(dy.dtype)
        if p.scale != 1.0:
            dyb.mul_(p.scale)
        dybs.append(dyb)
        As.append(A.to(dy.dtype))
        grads.append([None, (dy.t() @ xa).to(B.dtype)])
    dX = None
    if dybs:
        dyb_all = torch.cat(dybs, dim=1) if len(dybs) > 1 else dybs[0]
        dX = dyb_all @ (torch.cat(As) if len(As) > 1 else As[0])
        dA_all = dyb_all.t() @ X
        it = iter(dA_all.split(ranks, dim=0))
        for p, g, (A, _) in zip(projs, grads, pairs):
            if p.has_lora:
                g[0] = next(it).to(A.dtype)
    for p, dy in zip(projs, dys):
        W = p.weight(dy.dtype)
        if dX is None:
            dX = dy @ W
        else:
            dX.addmm_(dy, W)
        del W
    return dX, [tuple(g) for g in grads]


class LoRAProjFunction(torch.autograd.Function):
    """N LoRA projections of one input: forward(X, projs, need_y, *A_B) -> tuple of N outputs.

    ``need_y`` False (a checkpointed recompute whose outputs are replaced or discarded): only
    XAs is computed and saved; the outputs are uninitialised (see the module docstring).
    """

    @staticmethod
    def forward(ctx, X, projs, need_y, *ab):
        X2 = _flat(X)
        pairs = _split_ab(projs, ab)
        outs, XAs, ranks = _group_fwd(X2, projs, pairs, need_y)
        ctx.projs, ctx.xshape, ctx.ranks = projs, X.shape, ranks
        ctx.has_xa = XAs is not None
        ctx.save_for_backward(X2, *([XAs] if XAs is not None else []), *ab)
        return tuple(Y.view(*X.shape[:-1], Y.shape[-1]) for Y in outs)

    @staticmethod
    def backward(ctx, *dys):
        projs = ctx.projs
        saved = list(ctx.saved_tensors)
        X2 = saved.pop(0)
        XAs = saved.pop(0) if ctx.has_xa else None
        pairs = _split_ab(projs, saved)
        flat = []
        for p, dy in zip(projs, dys):
            if dy is None:
                dy = torch.zeros(*ctx.xshape[:-1], p.base.out_features, dtype=X2.dtype,
                                 device=X2.device)
            flat.append(_flat(dy).to(X2.dtype))
        dX, grads = _group_bwd(flat, X2, XAs, ctx.ranks, projs, pairs)
        return (dX.view(ctx.xshape), None, None, *_grads(projs, grads))


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
        pairs = _split_ab(projs, ab)
        (G, U), XAs, ranks = _group_fwd(X2, (pg, pu), pairs[:2])
        fwd, _ = _glu(impl)
        H = fwd(G, U, activation) if (need_y or pd.has_lora) else None
        if need_y:
            (Y,), HAs, _ = _group_fwd(H, (pd,), pairs[2:])
        else:  # recompute: Y's value is never read; only HAs (for dBd) is
            _, HAs, _ = _group_fwd(H, (pd,), pairs[2:], need_y=False) if pd.has_lora \
                else (None, None, None)
            Y = X2.new_empty(X2.shape[0], pd.base.out_features)
        del H
        ctx.projs, ctx.activation, ctx.impl, ctx.xshape, ctx.ranks = \
            projs, activation, impl, X.shape, ranks
        small = [t for t in (XAs, HAs) if t is not None]
        ctx.has = [t is not None for t in (XAs, HAs)]
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
        XAs, HAs = (next(it) if h else None for h in ctx.has)
        pairs = _split_ab(ctx.projs, rest[n:])
        fwd, bwd = _glu(ctx.impl)
        dY = _flat(dY).to(X2.dtype)
        H = fwd(G, U, ctx.activation) if pd.has_lora else None
        dH, (gd,) = _group_bwd([dY], H, HAs, [pairs[2][0].shape[0]] if pd.has_lora else [],
                               (pd,), pairs[2:])
        del H
        dG, dU = bwd(dH, G, U, ctx.activation)
        del dH
        dX, (gg, gu) = _group_bwd([dG, dU], X2, XAs, ctx.ranks, (pg, pu), pairs[:2])
        grads = _grads(ctx.projs, [gg, gu, gd])
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
