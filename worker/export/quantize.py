"""K-quants (and the other llama.cpp types) from an F16 GGUF through llama.cpp's own quantiser.

Calls ``llama_model_quantize(in, out, params)`` of ``llama-cpp-python``'s low-level binding
(``llama.h``), with ``params.ftype`` = ``LLAMA_FTYPE_MOSTLY_<TYPE>``; it returns 0 on success.
llama.cpp picks per-tensor types itself (e.g. Q4_K_M keeps some ``attn_v``/``ffn_down`` at
Q6_K; rows whose length is not a multiple of the block size fall back to a compatible type).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

from app.store.specs import GGUF_QUANTIZER_TYPES as LLAMA_TYPES

from .files import ExportError, atomic_path


def llama_cpp_available() -> str | None:
    """None when ``llama_cpp`` imports, else the reason it does not."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure (missing .so, ABI)
        return f"llama-cpp-python is not importable: {e}"
    return None


def quantize(f16_path: str | Path, out_path: str | Path, qtype: str,
             threads: int | None = None) -> dict:
    """Quantise ``f16_path`` to ``qtype`` at ``out_path`` (atomically)."""
    qtype = qtype.upper()
    if qtype not in LLAMA_TYPES:
        raise ExportError(f"quantization {qtype!r} is not one of {', '.join(LLAMA_TYPES)}")
    why = llama_cpp_available()
    if why:
        raise ExportError(why + "; K-quants need it (pip install llama-cpp-python)")
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}", None)
    if ftype is None:
        raise ExportError(f"this llama-cpp-python build has no {qtype}")
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads or max(1, (os.cpu_count() or 2) // 2)
    with atomic_path(out_path) as tmp:
        rc = llama_cpp.llama_model_quantize(str(f16_path).encode(), str(tmp).encode(),
                                            ctypes.byref(params))
        if rc != 0 or not tmp.exists():
            raise ExportError(f"llama.cpp quantiser failed for {qtype} (code {rc})")
    return {"path": str(out_path), "type": qtype}
