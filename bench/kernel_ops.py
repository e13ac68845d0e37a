"""Kernel benchmark: each op's forward and backward, Whetstone's Triton kernels against the PyTorch
reference (eager), torch.compile(reference) and liger-kernel's op where one exists, at Llama-3.1-8B
sizes (4096 and 16384 tokens, hidden 4096, MLP 14336, 32/8 heads of 128, vocab 128256), bf16.

Timing: CUDA events through triton.testing.do_bench (L2 flushed before each run), median, after
warm-up. Backward is timed as autograd.grad over a retained graph. ``fraction_of_bw`` = bytes that
must move (each input read once, each output written once) / time / the device-to-device copy bandwidth
measured at the start of the same run (bytes read + written). Peak memory: max allocated during one
fwd+bwd, absolute and above what was allocated before it. Each measurement is one JSON line appended to
--out (default bench/results.jsonl); all lines of a run share call_id.

    python bench/kernel_ops.py [--tokens 4096 16384] [--ops rms_norm rope swiglu geglu cross_entropy nf4]
    python bench/kernel_ops.py --smoke      # CPU, tiny shapes, Triton interpreter: checks the script only
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from whetstone_kernels.cross_entropy import linear_cross_entropy  # noqa: E402
from whetstone_kernels.nf4 import nf4_fwd  # noqa: E402
from whetstone_kernels.rms_norm import rms_norm  # noqa: E402
from whetstone_kernels.rope import rope  # noqa: E402
from whetstone_kernels.swiglu import glu  # noqa: E402
from whetstone_kernels.cross_entropy_ref import linear_cross_entropy_ref  # noqa: E402
from whetstone_kernels.nf4_ref import nf4_dequantize_ref, nf4_quantize_ref  # noqa: E402
from whetstone_kernels.rms_norm_ref import rms_norm_ref  # noqa: E402
from whetstone_kernels.rope_ref import rope_cos_sin, rope_inv_freq, rope_ref  # noqa: E402
from whetstone_kernels.swiglu_ref import glu_ref  # noqa: E402

GIB = 1 << 30


def _commit():
    if os.environ.get("WHETSTONE_COMMIT"):
        return os.environ["WHETSTONE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:
        return "unknown"


class Timer:
    def __init__(self, dev):
        self.dev = dev

    def ms(self, fn):
        if self.dev == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        fn()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    def sync(self):
        if self.dev == "cuda":
            torch.cuda.synchronize()


def copy_bandwidth(dev):
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    if dev != "cuda":
        return 1.0
    x = torch.randn(1 << 28, device=dev)  # 1 GiB
    y = torch.empty_like(x)
    ms = Timer(dev).ms(lambda: y.copy_(x))
    return 2 * x.numel() * 4 / ms / 1e6


def liger_ops():
    try:
        from liger_kernel.transformers import functional as lf
        return lf
    except Exception as e:  # not installed here
        print(f"# liger-kernel unavailable: {e!r}", file=sys.stderr)
        return None


def make_cases(tokens, dev, dtype, lf):
    """Yields (op, shape-string, bytes_fwd, bytes_bwd, make_inputs, {impl: fn}, grad_inputs)."""
    H, I, V, HQ, HK, D = 4096, 14336, 128256, 32, 8, 128
    if dev != "cuda":  # smoke sizes
        H, I, V, HQ, HK, D = 64, 96, 1000, 4, 2, 16
    e = torch.finfo(dtype).bits // 8
    for t in tokens:
        # LoRA case (frozen w, no dW) and full case (+dW; liger always computes dW)
        for with_dw in (False, True):
            impls = {"whetstone": lambda x, w: rms_norm(x, w),
                     "reference": lambda x, w: rms_norm_ref(x, w)}
            if lf is not None:
                impls["liger"] = lambda x, w: lf.liger_rms_norm(x, w, 1e-6, in_place=False)
            yield ("rms_norm", f"{t}x{H}" + ("+dW" if with_dw else ""), 2 * t * H * e + t * 4,
                   3 * t * H * e + t * 4 + (H * e if with_dw else 0),
                   (lambda: [torch.randn(t, H, device=dev, dtype=dtype),
                             torch.rand(H, device=dev, dtype=dtype) + 0.5]), impls,
                   (lambda x, w: rms_norm_ref(x, w)), (1,) if with_dw else (0,))

        for op, act in (("swiglu", "silu"), ("geglu", "gelu_tanh")):
            impls = {"whetstone": (lambda a, b, act=act: glu(a, b, act)),
                     "reference": (lambda a, b, act=act: glu_ref(a, b, act))}
            if lf is not None:
                impls["liger"] = lf.liger_swiglu if op == "swiglu" else lf.liger_geglu
            yield (op, f"{t}x{I}", 3 * t * I * e, 5 * t * I * e,
                   lambda: [torch.randn(t, I, device=dev, dtype=dtype), torch.randn(t, I, device=dev, dtype=dtype)],
                   impls, (lambda a, b, act=act: glu_ref(a, b, act)), (0, 1))

        cfg = {"hidden_size": H, "num_attention_heads": HQ, "head_dim": D, "rope_theta": 500000.0,
               "max_position_embeddings": 131072,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
        inv, att = rope_inv_freq(cfg, dev)
        cos, sin = rope_cos_sin(inv, torch.arange(t, device=dev)[None], att, dtype)
        impls = {"whetstone": lambda q, k: rope(q, k, cos, sin),
                 "reference": lambda q, k: rope_ref(q, k, cos, sin)}
        if lf is not None:
            impls["liger"] = lambda q, k: lf.liger_rope(q, k, cos, sin)
        qk = t * (HQ + HK) * D * e
        yield ("rope", f"1x{t}x({HQ}+{HK})x{D}", 2 * qk + 2 * t * D // 2 * e, 2 * qk + 2 * t * D // 2 * e,
               lambda: [torch.randn(1, t, HQ, D, device=dev, dtype=dtype).transpose(1, 2),
                        torch.randn(1, t, HK, D, device=dev, dtype=dtype).transpose(1, 2)],
               impls, lambda q, k: rope_ref(q, k, cos, sin), (0, 1))

        head = torch.randn(V, H, device=dev, dtype=dtype) / H ** 0.5
        labels = torch.randint(0, V, (t,), device=dev)
        labels[::7] = -100
        impls = {"whetstone": lambda h: linear_cross_entropy(h, head, labels),
                 "reference": lambda h: linear_cross_entropy_ref(h, head, labels)}
        if lf is not None:
            impls["liger"] = lambda h: lf.liger_fused_linear_cross_entropy(h, head, labels)
        yield ("cross_entropy", f"{t}x{H}->{V}", None, None, lambda: [torch.randn(t, H, device=dev, dtype=dtype)],
               impls, lambda h: linear_cross_entropy_ref(h, head, labels), (0,))
    # NF4: one MLP weight [14336, 4096] (independent of the token count)
    n_out, n_in = (I, H)
    packed, st = nf4_quantize_ref(torch.randn(n_out, n_in, device=dev) * 0.02)
    n = n_out * n_in
    impls = {"whetstone": lambda: nf4_fwd(packed, st, dtype),
             "reference": lambda: nf4_dequantize_ref(packed, st, dtype)}
    try:
        import bitsandbytes.functional as bf

        qp, qs = bf.quantize_4bit(torch.randn(n_out, n_in, device=dev, dtype=dtype) * 0.02, blocksize=64,
                                  compress_statistics=True, quant_type="nf4")
        impls["bitsandbytes"] = lambda: bf.dequantize_4bit(qp, qs)
    except Exception as ex:
        print(f"# bitsandbytes unavailable: {ex!r}", file=sys.stderr)
    yield ("nf4", f"{n_out}x{n_in}", n // 2 + n // 64 + n * e, None, lambda: [], impls,
           lambda: nf4_dequantize_ref(packed, st, dtype), ())


def graph_ms(timer, step):
    """Median time of a CUDA-graph replay of step() (no CPU launch overhead); None if capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        ms = timer.ms(g.replay)
        del g
        return ms
    except Exception as ex:
        print(f"#   graph capture failed ({ex!r})"[:200], flush=True)
        torch.cuda.synchronize()
        return None


def measure(timer, fn, inputs, grad_idx, use_graph=True):
    """Returns dict: eager fwd / fwd+bwd ms, graph fwd / fwd+bwd ms, peak memory (abs, above baseline)."""
    xs = [x.requires_grad_(i in grad_idx) for i, x in enumerate(inputs)]
    gx = [x for i, x in enumerate(xs) if i in grad_idx]
    r = {"fwd": timer.ms(lambda: fn(*xs))}
    if timer.dev == "cuda":
        timer.sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    out = fn(*xs)
    outs = out if isinstance(out, tuple) else (out,)
    gs = [torch.randn_like(o) for o in outs]

    def step():
        o = fn(*xs)
        torch.autograd.grad(o if isinstance(o, tuple) else (o,), gx, gs)

    if gx:
        torch.autograd.grad(outs, gx, gs)
    del out, outs
    if timer.dev == "cuda":
        timer.sync()
        r["peak"] = torch.cuda.max_memory_allocated() / GIB
        r["extra"] = (torch.cuda.max_memory_allocated() - base) / GIB
        if use_graph:
            r["graph_fwd"] = graph_ms(timer, lambda: fn(*xs))
            r["graph_fwdbwd"] = graph_ms(timer, step) if gx else None
    if gx:
        r["fwdbwd"] = timer.ms(step)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--ops", nargs="+", default=["rms_norm", "rope", "swiglu", "geglu", "cross_entropy", "nf4"])
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-liger", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also sweep RMSNorm backward programs per SM (with dW)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results.jsonl"))
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    tokens = [8, 13] if args.smoke else args.tokens
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    try:  # compiled backward graphs with donated buffers refuse to run twice over a retained graph
        import torch._functorch.config as fconf

        fconf.donated_buffer = False
    except Exception:
        pass
    timer = Timer(dev)
    bw = copy_bandwidth(dev)
    lf = None if args.no_liger or args.smoke else liger_ops()
    common = dict(bench="kernels", device=torch.cuda.get_device_name() if dev == "cuda" else "cpu-interpreter",
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), commit=_commit(),
                  call_id=uuid.uuid4().hex[:12], copy_gbps=round(bw, 1), torch=torch.__version__,
                  triton=__import__("triton").__version__)
    print(f"# copy bandwidth {bw:.0f} GB/s on {common['device']}; call_id {common['call_id']}", flush=True)
    rows = []
    with open(args.out, "a") as f:
        for op, shape, b_fwd, b_bwd, make, impls, ref, grad_idx in make_cases(tokens, dev, dtype, lf):
            if op not in args.ops:
                continue
            impls = dict(impls)
            if not args.no_compile and dev == "cuda":
                impls["compile"] = torch.compile(ref)  # per case: the references close over per-size tensors
            for impl, fn in impls.items():
                try:
                    # a failed capture leaves the CUDA RNG unusable: only capture what is known to capture.
                    # The LM head + CE takes 10-80 ms, where launch overhead does not matter: eager.
                    use_graph = op != "cross_entropy" and impl != "bitsandbytes"
                    r = measure(timer, fn, make(), grad_idx, use_graph)
                except Exception as ex:  # one failing baseline must not stop the run
                    print(f"# {op} {impl} failed: {ex!r}"[:300], flush=True)
                    continue
                g_f, g_fb = r.get("graph_fwd"), r.get("graph_fwdbwd")
                passes = []
                if op == "cross_entropy":
                    passes.append(("fwd+bwd", g_fb, r["fwdbwd"], None))
                else:
                    passes.append(("fwd", g_f, r["fwd"], b_fwd))
                    if "fwdbwd" in r:
                        passes.append(("bwd", (g_fb - g_f) if (g_fb and g_f) else None, r["fwdbwd"] - r["fwd"], b_bwd))
                for pas, gms, ems, nbytes in passes:
                    ms = gms if gms else ems
                    gbps = nbytes / ms / 1e6 if nbytes else None
                    row = dict(common, name=op, impl=impl, shape=shape, dtype=str(dtype).replace("torch.", ""),
                               ms=round(ms, 4), timing="cuda_graph" if gms else "eager", eager_ms=round(ems, 4),
                               gbps=round(gbps, 1) if gbps else None,
                               fraction_of_bw=round(gbps / bw, 3) if gbps else None,
                               peak_alloc_gib=round(r["peak"], 3) if "peak" in r else None,
                               extra_alloc_gib=round(r["extra"], 3) if "extra" in r else None,
                               bytes=nbytes, **{"pass": pas})
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(f"{op:13s} {pas:7s} {impl:12s} {shape:22s} {ms:8.3f} ms {row['timing'][:5]:5s} "
                          f"(eager {ems:7.3f}) {(gbps or 0):5.0f} GB/s {(row['fraction_of_bw'] or 0):5.2f} "
                          f"+{(row['extra_alloc_gib'] or 0):6.2f} GiB", flush=True)
        if args.sweep and dev == "cuda":
            rms_mod = sys.modules["whetstone_kernels.rms_norm"]
            keep = rms_mod.BWD_PROGS_PER_SM
            for t in tokens:
                for k in (1, 2, 3, 4, 8):
                    rms_mod.BWD_PROGS_PER_SM = k
                    x = torch.randn(t, 4096, device=dev, dtype=dtype, requires_grad=True)
                    w = (torch.rand(4096, device=dev, dtype=dtype) + 0.5).requires_grad_()
                    dy = torch.randn_like(x)
                    f_ms = graph_ms(timer, lambda: rms_norm(x, w))
                    fb_ms = graph_ms(timer, lambda: torch.autograd.grad(rms_norm(x, w), (x, w), dy))
                    ms = fb_ms - f_ms
                    gbps = (3 * t * 4096 * 2 + t * 4) / ms / 1e6
                    row = dict(common, bench="kernels-sweep", name="rms_norm", impl=f"whetstone progs/SM={k}",
                               shape=f"{t}x4096+dW", dtype="bfloat16", ms=round(ms, 4), timing="cuda_graph",
                               gbps=round(gbps, 1), fraction_of_bw=round(gbps / bw, 3), **{"pass": "bwd"})
                    f.write(json.dumps(row) + "\n")
                    print(f"sweep rms bwd+dW T={t} progs/SM={k:2d}: {ms:.4f} ms {gbps:.0f} GB/s "
                          f"{gbps / bw:.2f}", flush=True)
            rms_mod.BWD_PROGS_PER_SM = keep
    return rows


if __name__ == "__main__":
    main()
