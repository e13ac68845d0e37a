"""llama.cpp steps run in a child process: a crash or a hang fails the export step with a clear
message and leaves this (the worker's) process running; the child's own errors come back."""
from __future__ import annotations

import sys
import time

import pytest

from worker.export.files import ExportError
from worker.export.llama_child import OPS, call
from worker.export.quantize import llama_cpp_available

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process groups, signals")


def test_a_segfault_fails_the_step_not_the_worker():
    with pytest.raises(ExportError) as e:
        call("crash", {}, "verifying m-Q4_K_M.gguf", module="tests.export.crashing_child")
    msg = str(e.value)
    assert "crashed (SIGSEGV) while verifying m-Q4_K_M.gguf" in msg
    assert "worker is unaffected" in msg


def test_a_hang_is_stopped_at_the_time_limit():
    t0 = time.monotonic()
    waits = []
    with pytest.raises(ExportError) as e:
        call("hang", {}, "quantising m-Q4_K_M.gguf", timeout=3,
             on_wait=lambda: waits.append(1), module="tests.export.crashing_child")
    assert 3 <= time.monotonic() - t0 < 8
    assert "did not finish quantising m-Q4_K_M.gguf within 3 s" in str(e.value)
    assert waits  # the job's cancel check ran while it waited


def test_the_time_limit_is_the_setting(monkeypatch):
    """Without an explicit timeout the limit is Settings.llama_cpp_timeout_seconds, read from
    WHETSTONE_LLAMA_CPP_TIMEOUT_SECONDS (the export job passes its worker's setting)."""
    from app.settings import Settings, get_settings

    monkeypatch.setenv("WHETSTONE_LLAMA_CPP_TIMEOUT_SECONDS", "2")
    get_settings.cache_clear()
    try:
        assert get_settings().llama_cpp_timeout_seconds == 2.0
        t0 = time.monotonic()
        with pytest.raises(ExportError) as e:
            call("hang", {}, "verifying m-F16.gguf", module="tests.export.crashing_child")
        assert 2 <= time.monotonic() - t0 < 7
        assert "within 2 s" in str(e.value)
    finally:
        get_settings.cache_clear()
    monkeypatch.delenv("WHETSTONE_LLAMA_CPP_TIMEOUT_SECONDS")
    assert Settings().llama_cpp_timeout_seconds == 1800.0


def test_cancel_check_stops_the_child():
    class Cancelled(Exception):
        pass

    def cancel():
        raise Cancelled

    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        call("hang", {}, "x", timeout=60, on_wait=cancel, module="tests.export.crashing_child")
    assert time.monotonic() - t0 < 6


@pytest.mark.skipif(llama_cpp_available() is not None, reason=str(llama_cpp_available()))
def test_the_childs_error_comes_back(tmp_path):
    assert set(OPS) == {"quantize", "verify_gguf", "system_info"}
    (tmp_path / "bad.gguf").write_bytes(b"GGUF not really")
    with pytest.raises(ExportError) as e:
        call("quantize", {"f16_path": str(tmp_path / "bad.gguf"),
                          "out_path": str(tmp_path / "q.gguf"), "qtype": "Q4_K_M"}, "quantising")
    assert "llama.cpp quantiser failed for Q4_K_M" in str(e.value)
    assert not (tmp_path / "q.gguf").exists()
