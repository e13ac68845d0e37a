"""Architecture boundaries from DESIGN.md, checked on the source (AST) of every module.

* app/ (web, store, data, settings) never imports torch, triton, transformers, kernels or worker;
* app/store imports nothing from app.web;
* kernels import only torch, triton and the standard library (and each other).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)


def imported_roots(path: Path) -> set[str]:
    """Top-level module names imported by a Python file (absolute imports only)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def py_files(sub: str) -> list[Path]:
    return sorted((ROOT / sub).rglob("*.py"))


def test_there_are_files_to_check():
    assert len(py_files("app")) >= 10
    assert len(py_files("app/store")) >= 5


@pytest.mark.parametrize("path", py_files("app"), ids=lambda p: str(p.relative_to(ROOT)))
def test_app_never_imports_the_ml_stack(path: Path):
    banned = {"torch", "triton", "transformers", "peft", "trl", "kernels", "worker", "bitsandbytes"}
    bad = {n for n in imported_roots(path) if n.split(".")[0] in banned}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", py_files("app/store"), ids=lambda p: str(p.relative_to(ROOT)))
def test_store_has_no_web_imports(path: Path):
    bad = {n for n in imported_roots(path)
           if n.startswith("app.web") or n.split(".")[0] in {"fastapi", "starlette", "sse_starlette"}}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", py_files("kernels"), ids=lambda p: str(p.relative_to(ROOT)))
def test_kernels_import_only_torch_and_triton(path: Path):
    allowed = {"torch", "triton", "kernels", "__future__"} | STDLIB
    bad = {n for n in imported_roots(path) if n.split(".")[0] not in allowed}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
