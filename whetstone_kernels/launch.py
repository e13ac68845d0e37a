"""Cheaper Triton launches: ``launch(kernel, grid, *args, **kw)`` does what ``kernel[grid](*args, **kw)``
does, with less CPU work per call once a call of the same specialisation has been made.

Why: a training step queues ~1,000 Triton launches, and ``JITFunction.run`` (binder, cache key,
global-value check, the Python launcher wrapper) plus one ``cuPointerGetAttribute`` per pointer
argument cost tens of microseconds each on the host — the step's CPU side, not its GPU side, bounds
a checkpointed 2048 x 2 QLoRA step (bench/RESULTS.md, session 5).

How: the first call of each specialisation goes through Triton (compiling if needed) and returns its
``CompiledKernel``; that kernel's C launcher is kept under a key that holds everything Triton 3.6
specialises on (``native_specialize_impl``): per tensor its dtype, whether it is on the GPU and
whether its address is 16-byte aligned; per int whether it is 1, divisible by 16, and which of
i32 / i64 / u64 holds it; the type of a float / bool / None; the keyword arguments (constexprs and
options, with their types); Triton's debug and instrumentation knobs; and the device. Later calls
with the same key call that launcher directly with the tensors' addresses as ints.

The direct path is skipped (plain ``kernel[grid](...)``) under ``TRITON_INTERPRET=1``, when Triton
launch hooks are set (profilers), for a callable grid, for an argument the key does not describe
(a tensor subclass, an int subclass, a tuple, ``tl.constexpr``, an int no integer type holds), for
host tensors, for kernels that need scratch memory or have pre-run hooks or global values Triton
re-checks, when a keyword names a runtime (non-constexpr) argument, when
``WHETSTONE_FAST_LAUNCH=0``, and for any Triton whose ``CompiledKernel`` lacks the attributes
used here. Results are the same either way (the same
compiled kernel runs); ``tests/gpu/test_launch_gpu.py`` checks that.
"""
from __future__ import annotations

import os

import torch
import triton

from ._common import INTERPRET

FAST_LAUNCH = os.environ.get("WHETSTONE_FAST_LAUNCH", "1") == "1"

_I32, _I64 = 2 ** 31, 2 ** 63
_TENSOR, _PARAM = torch.Tensor, torch.nn.Parameter
_RT, _COMP = triton.knobs.runtime, triton.knobs.compilation
_PLANS: dict = {}
_NO_PLAN = object()

try:  # what Triton itself uses for the current stream
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # pragma: no cover - older torch
    def _raw_stream(dev):
        return torch.cuda.current_stream(dev).cuda_stream


def _int_spec(v: int):
    if v == 1:
        return 1
    if -_I32 <= v < _I32:
        return (v % 16 == 0, 0)
    if -_I64 <= v < _I64:
        return (v % 16 == 0, 1)
    if _I64 <= v < 2 * _I64:
        return (v % 16 == 0, 2)
    return None  # out of every integer type: Triton raises, so no direct path


def spec_key(args, kw, device: int):
    """The cache key of one launch: everything Triton specialises a compiled kernel on (module
    docstring), the keywords (names, values and the values' types: ``True``, ``1`` and ``1.0``
    differ), Triton's debug and instrumentation knobs, and the device index; or None when an
    argument is of a kind the key does not describe (tensor subclasses, int subclasses, tuples,
    ``tl.constexpr``, ints out of range, ...), which then always goes through Triton. Pure Python,
    no CUDA calls (~3 us for ten arguments and ten keywords)."""
    spec = []
    add = spec.append
    for a in args:
        t = type(a)
        if t is _TENSOR or t is _PARAM:
            add((a.dtype, a.is_cuda, a.data_ptr() % 16 == 0))
        elif t is int:
            if a != 1 and -_I32 <= a < _I32:
                add((a % 16 == 0, 0))
            else:
                s = _int_spec(a)
                if s is None:
                    return None
                add(s)
        elif t is float or t is bool or a is None:
            add(t)   # Triton: fp32 / u1 / constexpr None, never the value
        else:
            return None
    vals = tuple(kw.values())
    return (device, tuple(spec), tuple(kw), vals, tuple(map(type, vals)), _RT.debug,
            _COMP.instrumentation_mode)


def _hooks_set() -> bool:
    """True when a launch hook is registered (Triton 3.6 keeps them in HookChains, empty when unused)."""
    rt = triton.knobs.runtime
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return True
    return False


def _plan(kernel, compiled, args, kw: dict):
    """(C launch, function handle, packed metadata, cooperative, pdl, constexpr tail) or _NO_PLAN
    (host tensors among ``args``: Triton translates their addresses, the direct path would not)."""
    n_args = len(args)
    if any(isinstance(a, torch.Tensor) and not a.is_cuda for a in args):
        return _NO_PLAN
    try:
        launcher = compiled.run
        md = compiled.metadata
        if md.global_scratch_size or md.profile_scratch_size or not hasattr(launcher, "launch"):
            return _NO_PLAN
        if getattr(kernel, "pre_run_hooks", None) or getattr(kernel, "used_global_vals", None):
            return _NO_PLAN  # Triton runs / re-checks these on every call
        names = list(kernel.arg_names)
        params = kernel.params
        tail = []
        for p in params[n_args:]:
            name = names[p.num]
            if name in kw:
                if not p.is_constexpr:
                    return _NO_PLAN
                tail.append(kw[name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return _NO_PLAN
        if any(p.is_constexpr for p in params[:n_args]):
            return _NO_PLAN
        return (launcher.launch, compiled.function, compiled.packed_metadata,
                md.launch_cooperative_grid, md.launch_pdl, tuple(tail))
    except AttributeError:
        return _NO_PLAN


def launch(kernel, grid, *args, **kw):
    """Launch the ``@triton.jit`` ``kernel`` on ``grid`` (a tuple of 1-3 ints) with runtime
    arguments ``args`` (positional, in the kernel's order) and constexprs / launch options ``kw``
    (``num_warps=...`` etc.), on the current device and stream. Same effect as
    ``kernel[grid](*args, **kw)``; raises what Triton raises for bad arguments (the first call of a
    specialisation always goes through Triton)."""
    if not FAST_LAUNCH or INTERPRET or callable(grid):
        kernel[grid](*args, **kw)
        return
    dev = torch.cuda.current_device()
    spec = spec_key(args, kw, dev)
    if spec is None:
        kernel[grid](*args, **kw)
        return
    key = (kernel, spec)
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable keyword value (a list): Triton's own path
        kernel[grid](*args, **kw)
        return
    if plan is None or plan is _NO_PLAN or _hooks_set():
        compiled = kernel[grid](*args, **kw)
        if plan is None:
            _PLANS[key] = _plan(kernel, compiled, args, kw)
        return
    c_launch, function, meta, coop, pdl, tail = plan
    vals = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    g = len(grid)
    c_launch(grid[0], grid[1] if g > 1 else 1, grid[2] if g > 2 else 1,
             _raw_stream(dev), function, coop, pdl, None, None, meta, None, None,
             None, *vals, *tail)


def bound(kernel, grid, args, kw, slot: int):
    """A launcher of one fixed call whose only changing argument is the tensor at ``slot``:
    ``run(ptr) -> bool`` launches ``kernel`` on ``grid`` with ``args`` / ``kw``, ``args[slot]``
    replaced by the device address ``ptr`` (an int; the caller's tensor must have the dtype and the
    16-byte alignment of ``args[slot]``, the only things Triton specialises a tensor on), on the
    current stream. It returns False, launching nothing, when the direct path does not apply at
    call time (a launch hook was set, another device is current): the caller then launches through
    :func:`launch`.

    Returns None when the direct path does not apply to this call at all (the conditions of
    :func:`launch`) or when this specialisation has not been launched through :func:`launch` yet.
    Why: a frozen NF4 weight is dequantised ~600 times a training step with the same arguments but
    its output; binding them once skips the key, the plan lookup and the argument list, ~60 % of
    the launch's host time (bench/RESULTS.md, session 26)."""
    if not FAST_LAUNCH or INTERPRET or callable(grid):
        return None
    dev = torch.cuda.current_device()
    spec = spec_key(args, kw, dev)
    plan = _PLANS.get((kernel, spec)) if spec is not None else None
    if plan is None or plan is _NO_PLAN:
        return None
    c_launch, function, meta, coop, pdl, tail = plan
    vals = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    pre, post = tuple(vals[:slot]), tuple(vals[slot + 1:]) + tail
    g = len(grid)
    g0, g1, g2 = grid[0], grid[1] if g > 1 else 1, grid[2] if g > 2 else 1
    current = torch.cuda.current_device

    def run(ptr: int) -> bool:
        if current() != dev or _hooks_set():
            return False
        c_launch(g0, g1, g2, _raw_stream(dev), function, coop, pdl, None, None, meta, None, None,
                 None, *pre, ptr, *post)
        return True

    return run
