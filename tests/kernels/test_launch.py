"""whetstone_kernels.launch.spec_key must separate every pair of launches Triton would compile differently.

Two checks: per argument against ``native_specialize_impl`` (what Triton 3.6's binder calls for each
runtime argument), and per whole call against Triton's own binder + ``compute_cache_key`` on a toy
kernel (keywords, constexprs and options included). Equal keys must mean equal Triton keys; kinds
of argument the key does not describe must get no key (None: always through Triton)."""
import enum
import itertools

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature  # noqa: E402

from whetstone_kernels.launch import spec_key  # noqa: E402

native = pytest.importorskip("triton._C.libtriton").native_specialize_impl

_BUF = torch.zeros(64, dtype=torch.float32)
_BUF16 = torch.zeros(64, dtype=torch.bfloat16)
VALUES = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, -2 ** 31,
          -2 ** 31 - 1, 2 ** 40, 2 ** 63 - 1, 2 ** 63, 2 ** 63 + 16, 2 ** 64 - 16, 0.5, 1.0, 3.0, 1e300,
          True, False, None, _BUF, _BUF[1:], _BUF[4:], _BUF[2:], _BUF16, _BUF16[8:], _BUF16[1:]]


class _Sub(torch.Tensor):
    pass


class _IE(enum.IntEnum):
    A = 1
    B = 16
    C = 17


def _triton_spec(v):
    return native(BaseBackend, v, False, True, True)


def test_equal_keys_mean_equal_triton_specialisation():
    for a, b in itertools.product(VALUES, repeat=2):
        ka, kb = spec_key((a,), {}, 0), spec_key((b,), {}, 0)
        assert ka is not None and kb is not None
        if ka == kb:
            assert _triton_spec(a) == _triton_spec(b), (a, b)


def test_kinds_the_key_does_not_describe_get_no_key():
    """Int subclasses, tl.constexpr, tuples and ints no integer type holds: Triton's answer
    depends on them in ways the key does not follow, so they always go through Triton."""
    for v in (_IE.A, _IE.C, tl.constexpr(16), (1, 2), (_BUF, 16), 2 ** 64, 2 ** 64 + 1, -2 ** 63 - 1,
              _BUF.as_subclass(_Sub)):
        assert spec_key((_BUF, v), {}, 0) is None, v


def test_keys_separate_what_matters():
    assert spec_key((16,), {}, 0) != spec_key((17,), {}, 0)      # divisible by 16 or not
    assert spec_key((1,), {}, 0) != spec_key((17,), {}, 0)       # 1 is a constexpr
    assert spec_key((2 ** 31,), {}, 0) != spec_key((16,), {}, 0)  # i64 vs i32
    assert spec_key((2 ** 63,), {}, 0) != spec_key((2 ** 40,), {}, 0)  # u64 vs i64
    assert spec_key((_BUF,), {}, 0) != spec_key((_BUF[1:],), {}, 0)  # 16-byte alignment
    assert spec_key((_BUF,), {}, 0) != spec_key((_BUF16,), {}, 0)    # dtype
    assert spec_key((_BUF,), {"BLOCK": 64}, 0) != spec_key((_BUF,), {"BLOCK": 128}, 0)
    assert spec_key((_BUF,), {"FLAG": True}, 0) != spec_key((_BUF,), {"FLAG": 1}, 0)  # equal, not same
    assert spec_key((_BUF,), {}, 0) != spec_key((_BUF,), {}, 1)      # device
    # values Triton does not specialise on share a key (no recompile, no cache growth per value)
    assert spec_key((0.5,), {}, 0) == spec_key((3.0,), {}, 0)
    assert spec_key((17,), {}, 0) == spec_key((33,), {}, 0)
    assert spec_key((_BUF,), {}, 0) == spec_key((_BUF[4:],), {}, 0)


def test_debug_knob_is_in_the_key(monkeypatch):
    before = spec_key((_BUF,), {}, 0)
    monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    assert spec_key((_BUF,), {}, 0) != before


def _toy_fn(X, n, s, FLAG: tl.constexpr, BLOCK: tl.constexpr = 8):
    pass


_toy = JITFunction(_toy_fn)  # not triton.jit: under TRITON_INTERPRET=1 that is an InterpretedFunction


def test_equal_keys_mean_equal_triton_cache_keys():
    """Whole calls through Triton's binder and compute_cache_key (what selects the compiled kernel)."""
    binder = create_function_from_signature(_toy.signature, _toy.params, BaseBackend)

    def tkey(args, kw):
        _, spec, opts = binder(*args, **dict(kw, debug=False, instrumentation_mode=""))
        return compute_cache_key({}, spec, opts)

    calls = [((x, n, 0.5), {"FLAG": True}) for x in (_BUF, _BUF[1:], _BUF16) for n in (1, 16, 17, 2 ** 31)]
    calls += [((_BUF, 16, s), {"FLAG": f}) for s in (0.5, 2.0) for f in (True, 1, 1.0, False, 0, 0.0)]
    calls += [((_BUF, 16, 0.5), {"FLAG": True, "BLOCK": b}) for b in (8, 16, 16.0)]
    calls += [((_BUF, 16, 0.5), {"FLAG": True, "num_warps": w}) for w in (4, 4.0, 8)]
    for (a1, k1), (a2, k2) in itertools.combinations(calls, 2):
        s1, s2 = spec_key(a1, k1, 0), spec_key(a2, k2, 0)
        assert s1 is not None and s2 is not None
        if s1 == s2:
            assert tkey(a1, k1) == tkey(a2, k2), (a1[1:], k1, a2[1:], k2)


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: records what the C launcher would receive."""

    def __init__(self, calls):
        import collections

        Md = collections.namedtuple("Md", "global_scratch_size profile_scratch_size "
                                          "launch_cooperative_grid launch_pdl")
        self.metadata = Md(0, 0, False, True)
        self.function, self.packed_metadata = 1234, (4, 1, 0)
        self.run = type("Launcher", (), {"launch": staticmethod(lambda *a: calls.append(("direct", a)))})()


class _FakeKernel:
    """The toy kernel's real parameters; ``kernel[grid](...)`` records a call through Triton."""

    def __init__(self):
        self.params, self.arg_names = _toy.params, _toy.arg_names
        self.pre_run_hooks, self.used_global_vals, self.calls = [], {}, []
        self.compiled = _FakeCompiled(self.calls)

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.calls.append(("triton", grid, args, kw))
            return self.compiled
        return run


def test_direct_path_passes_triton_launchers_argument_list(monkeypatch):
    """The control flow of whetstone_kernels.launch.launch off the interpreter (no GPU here: fakes stand in
    for Triton's run and the compiled launcher; tests/gpu/test_launch_gpu.py runs the real ones).
    The first call of a key goes through Triton; the second reaches the C launcher with grid
    padded to 3, the stream, function, cooperative / pdl flags, no scratch, the packed metadata, no
    launch metadata or hooks, then every parameter in order: runtime args, keyword constexprs,
    defaults. Host tensors never get a direct path."""
    import whetstone_kernels.launch as L

    monkeypatch.setattr(L, "INTERPRET", False)
    monkeypatch.setattr(L, "FAST_LAUNCH", True)
    monkeypatch.setattr(L.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(L, "_raw_stream", lambda dev: 777)
    monkeypatch.setattr(L, "_PLANS", {})
    k = _FakeKernel()
    L.launch(k, (5,), 32, 17, 0.5, FLAG=True, num_warps=4)
    L.launch(k, (5,), 48, 33, 2.0, FLAG=True, num_warps=4)   # same key: 48, 33 divide by 16 as 32, 17
    assert [c[0] for c in k.calls] == ["triton", "direct"]
    assert k.calls[0][1:] == ((5,), (32, 17, 0.5), {"FLAG": True, "num_warps": 4})
    assert k.calls[1][1] == (5, 1, 1, 777, 1234, False, True, None, None, (4, 1, 0), None, None, None,
                             48, 33, 2.0, True, 8)
    L.launch(k, (5, 2), 48, 33, 2.0, FLAG=1, num_warps=4)   # FLAG=1 is another key: Triton again
    assert k.calls[-1][0] == "triton"
    n = len(k.calls)
    for _ in range(2):                                       # a host tensor: Triton every time
        L.launch(k, (5,), _BUF, 17, 0.5, FLAG=True)
    assert [c[0] for c in k.calls[n:]] == ["triton", "triton"]
    L.launch(k, (5,), 32, 17, 0.5, FLAG=[1, 2])              # unhashable keyword: Triton, no error
    assert k.calls[-1][0] == "triton"
    monkeypatch.setattr(k, "pre_run_hooks", [lambda *a, **kw: None])  # a kernel with pre-run hooks
    monkeypatch.setattr(L, "_PLANS", {})
    for _ in range(2):
        L.launch(k, (5,), 32, 17, 0.5, FLAG=True)
    assert [c[0] for c in k.calls[-2:]] == ["triton", "triton"]
