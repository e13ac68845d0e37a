"""Whetstone's training kernels: Triton forward/backward beside a plain-PyTorch reference per op.

Each ``<op>.py`` holds the Triton kernels, launchers ``<op>_fwd`` / ``<op>_bwd``, a
``torch.autograd.Function`` and a functional entry taking ``impl="triton" | "reference"``; each
``<op>_ref.py`` is plain PyTorch, runs on the CPU and is the numerical oracle. See
whetstone_kernels/README.md.

Importing this package imports torch and triton; the web process never imports it. The package
was called ``kernels`` until it shadowed Hugging Face's ``kernels`` library, which bitsandbytes
and transformers import by that name (every CPU training job logged bitsandbytes' failed
``from kernels import get_kernel``).
"""
from .cross_entropy import (LinearCrossEntropyFunction, linear_cross_entropy, linear_cross_entropy_bwd,
                            linear_cross_entropy_fwd)
from .nf4 import NF4LinearFunction, nf4_bwd, nf4_dequantize, nf4_fwd, nf4_linear
from .nf4_matmul import nf4_matmul
from .nf4_ref import NF4State, nf4_quantize_ref, nf4_state_from_bnb
from .rms_norm import RMSNormFunction, rms_norm, rms_norm_bwd, rms_norm_fwd
from .rope import RoPEFunction, rope, rope_bwd, rope_fwd
from .rope_ref import packed_position_ids, rope_cos_sin, rope_inv_freq
from .skinny_matmul import skinny_matmul
from .swiglu import (GLUFunction, geglu, geglu_bwd, geglu_fwd, glu, glu_bwd, glu_fwd, swiglu, swiglu_bwd,
                     swiglu_fwd)

__all__ = [
    "LinearCrossEntropyFunction", "linear_cross_entropy", "linear_cross_entropy_fwd", "linear_cross_entropy_bwd",
    "NF4LinearFunction", "NF4State", "nf4_dequantize", "nf4_fwd", "nf4_bwd", "nf4_linear", "nf4_matmul", "nf4_quantize_ref",
    "nf4_state_from_bnb", "skinny_matmul",
    "RMSNormFunction", "rms_norm", "rms_norm_fwd", "rms_norm_bwd",
    "RoPEFunction", "rope", "rope_fwd", "rope_bwd", "rope_inv_freq", "rope_cos_sin", "packed_position_ids",
    "GLUFunction", "glu", "glu_fwd", "glu_bwd", "swiglu", "swiglu_fwd", "swiglu_bwd", "geglu", "geglu_fwd",
    "geglu_bwd",
]
