"""Kernel tests on the CPU run the Triton kernels under the interpreter.

Triton decides interpreter-or-compile when a kernel is *decorated* (module import), so the variable
must be set before kernels/* is imported. This conftest sets it when CUDA is absent and, if some
earlier test in the same pytest process already imported kernel modules without it, reloads them.
"""
import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from triton import knobs  # triton >= 3.3 reads the variable through knobs

        knobs.runtime.interpret = True
    except Exception:  # pragma: no cover - older triton reads os.environ directly
        pass
    stale = [name for name in sorted(sys.modules) if name == "whetstone_kernels._common" or
             (name.startswith("whetstone_kernels.") and not name.endswith("_ref"))]
    if stale and not getattr(sys.modules.get("whetstone_kernels._common"), "INTERPRET", True):
        for name in stale:
            importlib.reload(sys.modules[name])
    if "whetstone_kernels" in sys.modules and stale:
        importlib.reload(sys.modules["whetstone_kernels"])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def pytest_collection_modifyitems(config, items):
    # numpy 1.26 deprecation noise from inside the Triton interpreter (one line per kernel launch)
    mark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
    for item in items:
        if "tests/kernels/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(mark)
