"""Device probe for the engine's attention and offload choices (one call, small, prints a table last).

    python3 bench/probe_attention.py [--seq 2048 --bs 2]

1. The aten attention ops the engine calls directly (so a checkpointed layer's recompute can reuse the
   forward's output and logsumexp instead of running attention again): cuDNN
   (``_scaled_dot_product_cudnn_attention``) and flash (``_flash_attention_forward``, also with
   cu_seqlens for packed batches), GQA (32 query / 8 key-value heads, head_dim 128, bf16, causal),
   each forward and backward checked against autograd through ``F.scaled_dot_product_attention``
   (relative error of out, dq, dk, dv), then timed (CUDA events, median of 20).
2. Pinned host <-> device copy bandwidth (32 MiB, one direction, then both at once beside a GEMM), to
   size how much a layer's forward may offload.
3. cuBLAS bf16 GEMM rates for the step's shapes (T = seq x bs tokens): the q/k/v, o, gate, up, down
   projections forward (X W^T) and backward (dY W), gate+up as one GEMM.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F


def timed(fn, n=20):
    ts = []
    for _ in range(3):
        fn()
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def attention_ops(seq, bs, rows):
    H, Hk, D = 32, 8, 128
    scale = D ** -0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(bs, H, seq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(bs, Hk, seq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(bs, Hk, seq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(bs, H, seq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o_ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale, enable_gqa=True)
    o_ref.backward(do)
    ref = (o_ref, qr.grad, kr.grad, vr.grad)
    t_sdpa = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                          enable_gqa=True))

    def sdpa_fb():
        a, b_, c = (t.detach().requires_grad_(True) for t in (q, k, v))
        F.scaled_dot_product_attention(a, b_, c, is_causal=True, scale=scale,
                                       enable_gqa=True).backward(do)
    rows.append(("sdpa autograd", "ok", 0.0, t_sdpa, timed(sdpa_fb) - t_sdpa))

    # cuDNN
    try:
        def cf():
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, True, False, scale=scale)
        r = cf()
        o, lse = r[0], r[1]

        def cb():
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                do, q, k, v, o, lse, r[6], r[7], torch.empty(0, device="cuda"), r[2], r[3],
                r[4], r[5], 0.0, True, scale=scale)
        dq, dk, dv = cb()
        err = max(rel(o, ref[0]), rel(dq, ref[1]), rel(dk, ref[2]), rel(dv, ref[3]))
        rows.append(("cudnn op", f"lse {tuple(lse.shape)} {lse.dtype}", err, timed(cf), timed(cb)))
    except Exception as e:  # noqa: BLE001
        rows.append(("cudnn op", f"FAILED {type(e).__name__}: {str(e)[:200]}", -1, 0, 0))

    # flash (dense layout [B, S, H, D])
    qf, kf, vf, dof = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    try:
        def ff():
            return torch.ops.aten._flash_attention_forward(
                qf, kf, vf, None, None, seq, seq, 0.0, True, False, scale=scale)
        r = ff()
        o, lse = r[0], r[1]

        def fb():
            return torch.ops.aten._flash_attention_backward(
                dof, qf, kf, vf, o, lse, None, None, seq, seq, 0.0, True, r[2], r[3],
                scale=scale)
        dq, dk, dv = fb()
        err = max(rel(o.transpose(1, 2), ref[0]), rel(dq.transpose(1, 2), ref[1]),
                  rel(dk.transpose(1, 2), ref[2]), rel(dv.transpose(1, 2), ref[3]))
        rows.append(("flash op", f"lse {tuple(lse.shape)}", err, timed(ff), timed(fb)))
    except Exception as e:  # noqa: BLE001
        rows.append(("flash op", f"FAILED {type(e).__name__}: {str(e)[:200]}", -1, 0, 0))

    # flash varlen: the bs sequences packed into one row, cu_seqlens
    try:
        qv, kv_, vv, dov = (t.reshape(1, bs * seq, -1, D) for t in (qf, kf, vf, dof))
        qv, kv_, vv, dov = (t.reshape(bs * seq, -1, D) for t in (qv, kv_, vv, dov))
        cu = torch.arange(0, bs + 1, device="cuda", dtype=torch.int32) * seq

        def vf_():
            return torch.ops.aten._flash_attention_forward(
                qv, kv_, vv, cu, cu, seq, seq, 0.0, True, False, scale=scale)
        r = vf_()
        o, lse = r[0], r[1]

        def vb():
            return torch.ops.aten._flash_attention_backward(
                dov, qv, kv_, vv, o, lse, cu, cu, seq, seq, 0.0, True, r[2], r[3], scale=scale)
        dq, dk, dv = vb()
        shp = lambda t, h: t.reshape(bs, seq, h, D).transpose(1, 2)  # noqa: E731
        err = max(rel(shp(o, H), ref[0]), rel(shp(dq, H), ref[1]), rel(shp(dk, Hk), ref[2]),
                  rel(shp(dv, Hk), ref[3]))
        rows.append(("flash varlen op", f"lse {tuple(lse.shape)}", err, timed(vf_), timed(vb)))
    except Exception as e:  # noqa: BLE001
        rows.append(("flash varlen op", f"FAILED {type(e).__name__}: {str(e)[:200]}", -1, 0, 0))


def copies(rows):
    n = 32 * 2**20 // 2
    dev = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    host2 = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    dev2 = torch.empty_like(dev)
    gb = n * 2 / 1e9
    t = timed(lambda: host.copy_(dev, non_blocking=True))
    rows.append(("D2H 32 MiB pinned", "", 0.0, t, gb / (t / 1e3)))
    t = timed(lambda: dev2.copy_(host, non_blocking=True))
    rows.append(("H2D 32 MiB pinned", "", 0.0, t, gb / (t / 1e3)))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
    t_gemm = timed(lambda: a @ w.t())

    def both():
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        for _ in range(4):
            with torch.cuda.stream(s1):
                host.copy_(dev, non_blocking=True)
            with torch.cuda.stream(s2):
                dev2.copy_(host2, non_blocking=True)
        for _ in range(8):
            a @ w.t()
        cur.wait_stream(s1)
        cur.wait_stream(s2)
    t = timed(both)
    rows.append(("4xD2H+4xH2D beside 8 GEMMs", f"GEMMs alone {8 * t_gemm:.2f} ms", 0.0, t,
                 8 * gb / (t / 1e3)))


def gemms(T, rows):
    Hs, I, KV = 4096, 14336, 1024
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(T, Hs, device="cuda", dtype=torch.bfloat16, generator=g)
    hx = torch.randn(T, I, device="cuda", dtype=torch.bfloat16, generator=g)
    for name, out_f, inp in (("qkv (fused 6144)", Hs + 2 * KV, x), ("q", Hs, x), ("k", KV, x),
                             ("o", Hs, x), ("gate", I, x), ("gate+up fused", 2 * I, x),
                             ("down", Hs, hx)):
        w = torch.randn(out_f, inp.shape[1], device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(T, out_f, device="cuda", dtype=torch.bfloat16, generator=g)
        fl = 2 * T * out_f * inp.shape[1]
        tf = timed(lambda: inp @ w.t())
        tb = timed(lambda: dy @ w)
        rows.append((f"GEMM {name} T={T}", f"fwd {fl / tf / 1e9:.0f} TF/s, bwd dX",
                     0.0, tf, fl / tb / 1e9))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=2)
    a = ap.parse_args()
    rows = []
    attention_ops(a.seq, a.bs, rows)
    copies(rows)
    gemms(a.seq * a.bs, rows)
    print(f"\n## probe seq {a.seq} bs {a.bs}: {torch.cuda.get_device_name()} torch {torch.__version__}")
    print("| what | note | max rel err | ms (fwd / copy) | ms bwd, GB/s or TF/s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.2e} | {r[3]:.3f} | {r[4]:.3f} |")


if __name__ == "__main__":
    main()
