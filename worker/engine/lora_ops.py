"""Fused LoRA linear autograd functions with hand-written backward (frozen base, trainable A, B).

For one projection with frozen base W [out, in] (dense, or NF4 dequantised on the fly), frozen bias
b, LoRA A [r, in], B [out, r] and scale s (alpha/r, or alpha/sqrt(r) with rsLoRA), on X [T, in]:

    forward:   XA = X A^T [T, r];   Y = X W^T + b + s XA B^T
    backward:  dYB = dY B [T, r]
               dX += dY W + s dYB A          dA = s dYB^T X          dB = s dY^T XA

:class:`LoRAProjFunction` runs N projections that read the same X (q, k, v together; gate and up;
o alone). In the order the GPU does it (:func:`_group_fwd`, :func:`_group_bwd`), with the group's
weights cast once per model forward (:class:`~worker.engine.lora_casts.CastCache`:
A = [A_1; ...; A_N] [sum r, in] and s_p B_p in the compute dtype, shared by the forward, the
recompute and the backward):

    XA = X A^T [T, sum r] (one GEMM, one pass over X);  Y_p = [R +] XA_p (s_p B_p)^T (small-K
          GEMM, writes Y_p, onto a residual R when given), then Y_p += X W_p^T in the base GEMM's
          epilogue (beta 1): Y is written once, never re-read for the LoRA add or the residual
    dYBs_p = dY_p s_p B_p, written side by side [T, sum r];  dX = dYBs A (one GEMM writes dX),
          then dX += dY_p W_p per projection (epilogue adds);  dA = dYBs^T X (one pass over X,
          split by rows);  dB_p = s_p dY_p^T XA_p;  dR = dY
dA, dB come out of the GEMM in A's / B's dtype (fp32 master weights: cuBLAS writes fp32 directly).
Saved: X (once) and XA [T, sum r]; W is re-dequantised in backward, never saved or stored dense.

:class:`LoRAMLPFunction` is the whole gated MLP, Y = [R +] down(act(gate(X)) * up(X)) with act silu
(SwiGLU) or gelu / gelu_tanh (GeGLU):

    forward:   G, U as one group of X;  H = act(G) U (whetstone_kernels.swiglu);  Y = down group of H
    backward:  dH = down group's dX (needs no H);  dG, dU, H = glu_bwd(dH, G, U) (one kernel: dG,
               dU over G, U, H over dH);  dAd = dYBd^T H;  then the gate/up group's backward.
Saved: X, G, U [T, I], XA of gate/up [T, 2r], HA of down [T, r]; H is not saved.

``need_y`` False (a checkpointed layer's recompute, where an output only feeds a value that is
discarded or replaced: :func:`~worker.engine.patch.run_layer`) skips the base projections: for the
MLP no Wd dequant and no H Wd^T [T, I] x [I, H] matmul (~27 % of a Llama layer's linear FLOPs); for
:class:`LoRAProjFunction` no base at all; no residual add either. XA (what dB needs) is still
computed and saved, and the outputs are ``torch.empty`` in X's dtype: uninitialised, never read.
Backward is unchanged.

Dtypes: the compute dtype is X's (bf16 on GPU, fp32 in tests); A, B (fp32 master weights or X's
dtype) are cast to it (fp32 in fp32: no copy), and dA, dB come back in A's / B's dtype. Only dX,
dA, dB are computed: the base weight and bias are frozen. ``impl`` picks the NF4 dequant and GLU
kernels ("triton" | "reference"); the matmuls are torch's either way. Shapes: X [..., in] is
flattened to T rows; outputs keep X's leading dims. :func:`proj_forward` / :func:`mlp_forward` are
the forwards without autograd (the no-grad path: a checkpointed forward, eval).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from worker.engine.lora_casts import CastCache, Casts, make_casts  # noqa: F401 (re-exported)


@dataclass(eq=False)
class Proj:
    """One projection: its frozen base module, optional frozen bias, and the LoRA scale.

    ``has_lora`` False means a frozen projection (no LoRA on it); then no A, B tensors are passed.
    """

    base: nn.Module
    bias: torch.Tensor | None
    scale: float
    has_lora: bool


def _weights(projs, dtype) -> list:
    """The group's base weights [W_p] (quant.dense_weights)."""
    from worker.engine.quant import dense_weights

    return dense_weights([p.base for p in projs], dtype)


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


_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def _mm_to(a, b, dtype):
    """a @ b returned in ``dtype``: on CUDA a 16-bit GEMM writes fp32 directly (cuBLAS, no
    rounding to 16 bits, no cast kernel); elsewhere the product is cast."""
    if a.dtype == dtype:
        return a @ b
    if a.is_cuda and _MM_OUT_DTYPE and dtype == torch.float32:
        return torch.mm(a, b, out_dtype=dtype)
    return (a @ b).to(dtype)


def _casts(cache, projs, pairs, dtype) -> Casts:
    return cache.get(projs, pairs, dtype) if cache is not None else make_casts(projs, pairs, dtype)


def _group_fwd(X, projs, casts: Casts, need_y=True, R=None):
    """Y_p = [R +] X W_p^T + b_p + XA_p (s_p B_p)^T for the projections of one input X [T, in].

    XA = X [A_1; A_2; ...]^T [T, sum r] is one GEMM for the group (unscaled; backward keeps it).
    Each LoRA term is written first (a small-K GEMM, onto the residual R [T, out] when given: one
    projection only) and the base GEMM adds onto it in its epilogue (addmm_, beta 1), so Y is
    written once and never re-read for the LoRA add. ``need_y`` False skips the base (no dequant,
    no GEMM) and R: Y uninitialised. Returns ([Y_p], XA or None).
    """
    XA = X @ casts.A.t() if casts.A is not None else None
    xas = iter(XA.split(casts.ranks, dim=1)) if XA is not None else iter(())
    outs = []
    Ws = _weights(projs, X.dtype) if need_y else None
    for i, (p, Bs) in enumerate(zip(projs, casts.Bs)):
        xa = next(xas) if p.has_lora else None
        if not need_y:
            outs.append(X.new_empty(X.shape[0], p.base.out_features))
            continue
        W, Ws[i] = Ws[i], None
        if xa is not None:
            Y = torch.addmm(R, xa, Bs.t()) if R is not None else xa @ Bs.t()
            Y.addmm_(X, W.t())
        else:
            Y = torch.addmm(R, X, W.t()) if R is not None else X @ W.t()
        del W
        if p.bias is not None:
            Y += p.bias.to(Y.dtype)
        outs.append(Y)
    return outs, XA


def _lora_dy(dys, XA, projs, casts: Casts, pairs):
    """The LoRA half of a group's backward that reads dY: dYBs = [dY_p s_p B_p] [T, sum r] and
    each dB_p = s_p dY_p^T XA_p (in B's dtype); returns (dYBs or None, [dB_p or None])."""
    if casts.A is None:
        return None, [None] * len(projs)
    T, R = dys[0].shape[0], sum(casts.ranks)
    one = len(casts.ranks) == 1
    dyb_all = None if one else dys[0].new_empty(T, R)
    xas = iter(XA.split(casts.ranks, dim=1))
    dBs, off = [], 0
    for p, (_, B), Bs, dy in zip(projs, pairs, casts.Bs, dys):
        if not p.has_lora:
            dBs.append(None)
            continue
        r = Bs.shape[1]
        if one:
            dyb_all = dy @ Bs
        else:
            torch.mm(dy, Bs, out=dyb_all[:, off:off + r])
        off += r
        dB = _mm_to(dy.t(), next(xas), B.dtype)
        if p.scale != 1.0:
            dB.mul_(p.scale)
        dBs.append(dB)
    return dyb_all, dBs


def _lora_da(dyb_all, X, projs, casts: Casts, pairs):
    """dA_p = s_p (dY_p B_p)^T X for the whole group in one pass over X; [dA_p or None]."""
    if dyb_all is None:
        return [None] * len(projs)
    a_dtype = next(A.dtype for p, (A, _) in zip(projs, pairs) if p.has_lora)
    dA_all = _mm_to(dyb_all.t(), X, a_dtype)
    it = iter(dA_all.split(casts.ranks, dim=0))
    return [next(it).to(A.dtype) if p.has_lora else None for p, (A, _) in zip(projs, pairs)]


def _base_dx(dX, dys, projs):
    """dX (+)= sum_p dY_p W_p (the group's W from :func:`_weights`; epilogue adds onto dX when it
    exists)."""
    Ws = _weights(projs, dys[0].dtype)
    for i, dy in enumerate(dys):
        W, Ws[i] = Ws[i], None
        if dX is None:
            dX = dy @ W
        else:
            dX.addmm_(dy, W)
        del W
    return dX


def _group_bwd(dys, X, XA, projs, casts: Casts, pairs):
    """dX = sum_p dY_p W_p + s_p dY_p B_p A_p and each (dA_p, dB_p); dys [T, out_p] in X's dtype.

    The dY_p s_p B_p [T, r_p] are written side by side, so the LoRA part of dX is one GEMM
    [T, sum r] x [sum r, in] that writes dX, and dA for the whole group is one pass over X; every
    base dY_p W_p then adds onto dX in the GEMM epilogue.
    """
    dyb_all, dBs = _lora_dy(dys, XA, projs, casts, pairs)
    dX = dyb_all @ casts.A if dyb_all is not None else None
    dAs = _lora_da(dyb_all, X, projs, casts, pairs)
    return _base_dx(dX, dys, projs), list(zip(dAs, dBs))


def proj_forward(X, projs, need_y, cache, R, ab):
    """LoRAProjFunction's forward without autograd (also the no-grad path: no ctx, nothing saved):
    (outputs [..., out_p] with X's leading dims, XA [T, sum r] or None, Casts)."""
    X2 = _flat(X)
    pairs = _split_ab(projs, ab)
    casts = _casts(cache, projs, pairs, X.dtype)
    outs, XA = _group_fwd(X2, projs, casts, need_y, None if R is None else _flat(R))
    return tuple(Y.view(*X.shape[:-1], Y.shape[-1]) for Y in outs), XA, casts


class LoRAProjFunction(torch.autograd.Function):
    """N LoRA projections of one input: forward(X, projs, need_y, cache, R, *A_B) -> N outputs.

    ``cache`` is the forward's :class:`CastCache` (or None: cast here). ``R`` (one projection only,
    or None) is a residual added to the output in the GEMMs (Y = R + proj(X); dR = dY).
    ``need_y`` False (a checkpointed recompute whose outputs are replaced or discarded): only
    XA is computed and saved; the outputs are uninitialised (see the module docstring).
    """

    @staticmethod
    def forward(ctx, X, projs, need_y, cache, R, *ab):
        outs, XA, casts = proj_forward(X, projs, need_y, cache, R, ab)
        ctx.projs, ctx.xshape, ctx.casts, ctx.has_r = projs, X.shape, casts, R is not None
        ctx.has_xa = XA is not None
        ctx.save_for_backward(_flat(X), *([XA] if XA is not None else []), *ab)
        return outs

    @staticmethod
    def backward(ctx, *dys):
        projs = ctx.projs
        saved = list(ctx.saved_tensors)
        X2 = saved.pop(0)
        XA = saved.pop(0) if ctx.has_xa else None
        pairs = _split_ab(projs, saved)
        flat = []
        for p, dy in zip(projs, dys):
            if dy is None:
                dy = torch.zeros(*ctx.xshape[:-1], p.base.out_features, dtype=X2.dtype,
                                 device=X2.device)
            flat.append(_flat(dy).to(X2.dtype))
        dX, grads = _group_bwd(flat, X2, XA, projs, ctx.casts, pairs)
        dR = dys[0] if ctx.has_r else None
        return (dX.view(ctx.xshape), None, None, None, dR, *_grads(projs, grads))


def _glu(impl):
    """(fwd(G, U, act) -> H, bwd(dH, G, U, act) -> (dG, dU, H)) of ``impl``; the Triton backward
    writes dG, dU over G, U and H over dH (nothing allocated)."""
    if impl == "triton":
        from whetstone_kernels.swiglu import glu_bwd, glu_fwd

        return glu_fwd, lambda dh, g, u, act: glu_bwd(dh, g, u, act, inplace=True, emit_h=True)
    from whetstone_kernels.swiglu_ref import glu_ref, glu_ref_bwd

    return glu_ref, lambda dh, g, u, act: glu_ref_bwd(dh, g, u, act, emit_h=True)


def mlp_forward(X, projs, activation, impl, need_y, cache, R, ab):
    """LoRAMLPFunction's forward without autograd (also the no-grad path): (Y [..., H] with X's
    leading dims, (G, U [T, I], XA, HA, (Casts of gate/up, Casts of down)))."""
    X2 = _flat(X)
    pg, pu, pd = projs
    pairs = _split_ab(projs, ab)
    cgu = _casts(cache, (pg, pu), pairs[:2], X.dtype)
    cd = _casts(cache, (pd,), pairs[2:], X.dtype)
    (G, U), XA = _group_fwd(X2, (pg, pu), cgu)
    fwd, _ = _glu(impl)
    H = fwd(G, U, activation) if (need_y or pd.has_lora) else None
    if need_y:
        (Y,), HA = _group_fwd(H, (pd,), cd, R=None if R is None else _flat(R))
    else:  # recompute: Y's value is never read; only HA (for dBd) is
        HA = _group_fwd(H, (pd,), cd, need_y=False)[1] if pd.has_lora else None
        Y = X2.new_empty(X2.shape[0], pd.base.out_features)
    return Y.view(*X.shape[:-1], Y.shape[-1]), (G, U, XA, HA, (cgu, cd))


class LoRAMLPFunction(torch.autograd.Function):
    """forward(X, (gate, up, down), activation, impl, need_y, cache, R, *A_B) -> Y = [R +] the
    gated MLP with LoRA on each projection. ``cache``: the forward's :class:`CastCache` or None;
    ``R``: a residual added in the down GEMM (dR = dY) or None; ``need_y`` False: Y is left
    uninitialised (see the module docstring)."""

    @staticmethod
    def forward(ctx, X, projs, activation, impl, need_y, cache, R, *ab):
        Y, (G, U, XA, HA, casts) = mlp_forward(X, projs, activation, impl, need_y, cache, R, ab)
        ctx.projs, ctx.activation, ctx.impl, ctx.xshape = projs, activation, impl, X.shape
        ctx.casts, ctx.has_r = casts, R is not None
        small = [t for t in (XA, HA) if t is not None]
        ctx.has = [t is not None for t in (XA, HA)]
        ctx.save_for_backward(_flat(X), G, U, *small, *ab)
        return Y

    @staticmethod
    def backward(ctx, dY):
        pg, pu, pd = ctx.projs
        cgu, cd = ctx.casts
        saved = list(ctx.saved_tensors)
        X2, G, U = saved[:3]
        rest = saved[3:]
        n = sum(ctx.has)
        it = iter(rest[:n])
        XA, HA = (next(it) if h else None for h in ctx.has)
        pairs = _split_ab(ctx.projs, rest[n:])
        _, bwd = _glu(ctx.impl)
        dY2 = _flat(dY).to(X2.dtype)
        # down: dH = dY Wd + s dY Bd Ad (H is not needed yet), dBd
        dyb, (dBd,) = _lora_dy([dY2], HA, (pd,), cd, pairs[2:])
        dH = _base_dx(dyb @ cd.A if dyb is not None else None, [dY2], (pd,))
        dG, dU, H = bwd(dH, G, U, ctx.activation)  # H = act(G) U, for dAd, in dH's memory
        del dH
        (dAd,) = _lora_da(dyb, H, (pd,), cd, pairs[2:])
        del H, dyb
        dX, (gg, gu) = _group_bwd([dG, dU], X2, XA, (pg, pu), cgu, pairs[:2])
        grads = _grads(ctx.projs, [gg, gu, (dAd, dBd)])
        dR = dY if ctx.has_r else None
        return (dX.view(ctx.xshape), None, None, None, None, None, dR, *grads)


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
