"""Architecture boundaries from DESIGN.md, checked on the source (AST) of every module.

* app/ (web, store, data, settings) never imports torch, triton, transformers, whetstone_kernels or worker;
* app/store imports nothing from app.web;
* app/studio (the use cases) imports no web framework and nothing from app.web;
* a web module that defines routes never imports another module that defines routes (shared
  code lives in app.studio or in route-free web modules);
* whetstone_kernels import only torch, triton and the standard library (and each other).
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
    banned = {"torch", "triton", "transformers", "peft", "trl", "whetstone_kernels", "worker",
              "bitsandbytes"}
    bad = {n for n in imported_roots(path) if n.split(".")[0] in banned}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", py_files("app/store"), ids=lambda p: str(p.relative_to(ROOT)))
def test_store_has_no_web_imports(path: Path):
    bad = {n for n in imported_roots(path)
           if n.startswith("app.web") or n.split(".")[0] in {"fastapi", "starlette", "sse_starlette"}}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", py_files("whetstone_kernels"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_kernels_import_only_torch_and_triton(path: Path):
    allowed = {"torch", "triton", "whetstone_kernels", "__future__"} | STDLIB
    bad = {n for n in imported_roots(path) if n.split(".")[0] not in allowed}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


WEB_FRAMEWORKS = {"fastapi", "starlette", "sse_starlette", "jinja2", "uvicorn", "multipart",
                  "python_multipart"}


@pytest.mark.parametrize("path", py_files("app/studio"), ids=lambda p: str(p.relative_to(ROOT)))
def test_studio_has_no_web_imports(path: Path):
    bad = {n for n in imported_roots(path)
           if n.startswith("app.web") or n.split(".")[0] in WEB_FRAMEWORKS}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def defines_routes(path: Path) -> bool:
    """True when the module creates an APIRouter (a route module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "APIRouter"
               for n in ast.walk(tree))


ROUTE_MODULES = [p for p in py_files("app/web") if defines_routes(p)]


def test_route_modules_are_found():
    names = {module_name(p) for p in ROUTE_MODULES}
    assert {"app.web.routes.runs", "app.web.api.runs", "app.web.openai.jobs"} <= names


@pytest.mark.parametrize("path", ROUTE_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_route_modules_never_import_each_other(path: Path):
    others = {module_name(p) for p in ROUTE_MODULES} - {module_name(path)}
    imported = imported_roots(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):  # "from app.web.routes import runs" names the module too
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported |= {f"{node.module}.{a.name}" for a in node.names}
    bad = sorted(imported & others)
    assert not bad, f"{path.relative_to(ROOT)} imports the route modules {bad}"
