"""The worker's start-up check of the llama.cpp build (worker/export/llama_build.py): the build's
instruction sets against the CPU's, and the installed build is the Makefile's portable one."""
from __future__ import annotations

import pytest

from worker.export.llama_build import assess, build_features, check, cpu_flags
from worker.export.quantize import llama_cpp_available

PORTABLE_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 "
                 "| LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
NATIVE_INFO = PORTABLE_INFO.replace("BMI2 = 1 |", "BMI2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | "
                                                  "AMX_INT8 = 1 |")
ZEN3 = "processor : 0\nflags\t\t: fpu sse pni ssse3 avx avx2 f16c fma bmi2\n"
SAPPHIRE = ZEN3.replace("bmi2", "bmi2 avx512f avx512_vnni amx_int8")


def test_a_native_build_on_a_cpu_without_its_instructions_is_an_error():
    assert build_features(NATIVE_INFO) == {"SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA",
                                           "BMI2", "AVX512", "AVX512_VNNI", "AMX_INT8"}
    level, msg = assess(NATIVE_INFO, cpu_flags(ZEN3))
    assert level == "error"
    assert "built with AMX_INT8, AVX512, AVX512_VNNI, which this CPU lacks" in msg
    assert "make setup" in msg


def test_a_native_build_where_it_was_built_is_a_warning():
    level, msg = assess(NATIVE_INFO, cpu_flags(SAPPHIRE))
    assert level == "warning" and "AMX_INT8, AVX512, AVX512_VNNI (a -march=native" in msg


def test_the_portable_build_is_fine_anywhere():
    assert assess(PORTABLE_INFO, cpu_flags(ZEN3)) == (
        "info", "llama-cpp-python build: AVX, AVX2, BMI2, F16C, FMA, SSE3, SSSE3")
    assert assess(PORTABLE_INFO, None)[0] == "info"  # no /proc/cpuinfo: judged by the build
    assert cpu_flags("no flags here") is None


@pytest.mark.skipif(llama_cpp_available() is not None, reason=str(llama_cpp_available()))
def test_the_installed_build_is_the_makefiles():
    """make setup builds with GGML_NATIVE=OFF (its own wheel, not pip's cache): no AVX-512/AMX."""
    level, msg = check()
    assert level == "info", msg
