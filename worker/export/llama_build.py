"""Check at worker start that the installed llama.cpp build fits this CPU.

``make setup`` builds llama-cpp-python with ``GGML_NATIVE=OFF`` (the Makefile's
``LLAMA_CMAKE_ARGS``): x86 code paths up to AVX2/FMA/F16C/BMI2 (ggml's defaults when not
native), which run on any x86-64 CPU of the last decade. A wheel built elsewhere with
``-march=native`` (a plain ``pip install``, or pip's wheel cache reusing one) may instead
contain AVX-512 or AMX code that dies with SIGILL/SIGSEGV on a CPU without them. The llama.cpp
steps run in a child process (:mod:`worker.export.llama_child`), so such a crash fails one
export; this check names the cause up front, in the worker's log.

The build's instruction sets come from ``llama_print_system_info()`` (``AVX512 = 1 | ...``),
read in a child process (loading a bad build must not risk the worker), and are compared with
the CPU's flags in ``/proc/cpuinfo``.
"""
from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

log = logging.getLogger("worker.export")

#: ``llama_print_system_info`` name -> ``/proc/cpuinfo`` flag.
CPU_FLAG = {"SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX2": "avx2", "F16C": "f16c",
            "FMA": "fma", "BMI2": "bmi2", "AVX_VNNI": "avx_vnni", "AVX512": "avx512f",
            "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni",
            "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8"}
#: What the Makefile's build (GGML_NATIVE=OFF) enables on x86-64.
PORTABLE = {"SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2"}


def system_info() -> str:
    """``llama_print_system_info()`` of the installed llama-cpp-python (child-process op)."""
    from llama_cpp import llama_cpp

    return llama_cpp.llama_print_system_info().decode(errors="replace")


def build_features(info: str) -> set[str]:
    """The x86 instruction sets a ``system_info`` string says the build uses (``NAME = 1``)."""
    return {n for n, v in re.findall(r"([A-Z0-9_]+) = (\d+)", info) if v != "0" and n in CPU_FLAG}


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU's flags from ``/proc/cpuinfo`` (or the given text); None where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    m = re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.M)
    return set(m.group(1).split()) if m else None


def assess(info: str, flags: set[str] | None) -> tuple[str, str]:
    """``(level, message)``: ``"error"`` when the build uses instructions this CPU lacks (its
    GGUF steps would crash), ``"warning"`` when it uses more than the Makefile's portable set
    (a native build: fine here, not on another machine), else ``"info"``."""
    used = build_features(info)
    extra = sorted(used - PORTABLE)
    if flags is not None:
        missing = sorted(f for f in used if CPU_FLAG[f] not in flags)
        if missing:
            return "error", (f"llama-cpp-python was built with {', '.join(missing)}, which this "
                             "CPU lacks: GGUF quantising and verification will crash (each "
                             "export fails alone). Rebuild it here: make setup (GGML_NATIVE=OFF)")
    if extra:
        return "warning", (f"llama-cpp-python was built with {', '.join(extra)} (a -march=native "
                           "build, not the Makefile's GGML_NATIVE=OFF): it runs on this CPU but "
                           "crashes on one without them")
    return "info", f"llama-cpp-python build: {', '.join(sorted(used)) or 'no x86 extensions'}"


def check() -> tuple[str, str]:
    """Read the build's info in a child process and :func:`assess` it; ``("warning", why)``
    when it cannot be read (llama-cpp-python missing or crashing on import)."""
    from .files import ExportError
    from .llama_child import call

    try:
        info = call("system_info", {}, "reading llama.cpp's build info", timeout=120)
    except ExportError as e:
        return "warning", f"llama.cpp's build info could not be read: {e}"
    return assess(str(info), cpu_flags())


def check_in_background() -> threading.Thread:
    """Run :func:`check` on a daemon thread and log its message at its level (worker start)."""
    def run() -> None:
        level, message = check()
        getattr(log, level)(message)

    t = threading.Thread(target=run, name="llama-build-check", daemon=True)
    t.start()
    return t
