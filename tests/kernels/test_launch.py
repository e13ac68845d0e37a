"""kernels.launch.spec_key must separate every pair of launches Triton would compile differently:
over a grid of argument values, equal keys imply equal ``native_specialize_impl`` results (the
function Triton 3.6's binder calls for every runtime argument)."""
import itertools

import pytest
import torch

from kernels.launch import spec_key

native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
BaseBackend = pytest.importorskip("triton.backends.compiler").BaseBackend

_BUF = torch.zeros(64, dtype=torch.float32)
_BUF16 = torch.zeros(64, dtype=torch.bfloat16)
VALUES = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, -2 ** 31,
          -2 ** 31 - 1, 2 ** 40, 2 ** 63 - 1, 2 ** 63, 2 ** 63 + 16, 0.5, 1.0, 3.0, True, False, None,
          _BUF, _BUF[1:], _BUF[4:], _BUF[2:], _BUF16, _BUF16[8:], _BUF16[1:]]


def _triton_spec(v):
    return native(BaseBackend, v, False, True, True)


def test_equal_keys_mean_equal_triton_specialisation():
    for a, b in itertools.product(VALUES, repeat=2):
        if spec_key((a,), {}, 0) == spec_key((b,), {}, 0):
            assert _triton_spec(a) == _triton_spec(b), (a, b)


def test_keys_separate_what_matters():
    assert spec_key((16,), {}, 0) != spec_key((17,), {}, 0)      # divisible by 16 or not
    assert spec_key((1,), {}, 0) != spec_key((17,), {}, 0)       # 1 is a constexpr
    assert spec_key((2 ** 31,), {}, 0) != spec_key((16,), {}, 0)  # i64 vs i32
    assert spec_key((_BUF,), {}, 0) != spec_key((_BUF[1:],), {}, 0)  # 16-byte alignment
    assert spec_key((_BUF,), {}, 0) != spec_key((_BUF16,), {}, 0)    # dtype
    assert spec_key((_BUF,), {"BLOCK": 64}, 0) != spec_key((_BUF,), {"BLOCK": 128}, 0)
    assert spec_key((_BUF,), {}, 0) != spec_key((_BUF,), {}, 1)      # device
    # values Triton does not specialise on share a key (no recompile, no cache growth per value)
    assert spec_key((0.5,), {}, 0) == spec_key((3.0,), {}, 0)
    assert spec_key((17,), {}, 0) == spec_key((33,), {}, 0)
    assert spec_key((_BUF,), {}, 0) == spec_key((_BUF[4:],), {}, 0)
