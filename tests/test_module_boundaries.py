"""Imports that must run one way: the router and the API server share `pdserve.http`, never each other;
`pdserve.disagg` implements the engine's connector contract (engine/kv_connector.py) and the engine
never imports it back, except in the composition root that wires them (engine/build.py, and the entry);
processes that do not compute never import torch at module level (checked on live processes in test_launch.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "pdserve"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("package,forbidden", [("router", "pdserve.api"), ("api", "pdserve.router"),
                                               ("http", "pdserve.api"), ("http", "pdserve.router")])
def test_packages_do_not_import_each_other(package: str, forbidden: str):
    offenders = {f"{p.relative_to(PKG)}: {m}" for p in (PKG / package).rglob("*.py") for m in _imports(p)
                 if m == forbidden or m.startswith(forbidden + ".")}
    assert not offenders, offenders


def test_the_engine_does_not_import_disagg():
    roots = {PKG / "engine" / "__main__.py", PKG / "engine" / "build.py"}  # the composition root: connectors plug in
    offenders = {f"{p.relative_to(PKG)}: {m}" for p in (PKG / "engine").rglob("*.py") if p not in roots
                 for m in _imports(p) if m == "pdserve.disagg" or m.startswith("pdserve.disagg.")}
    assert not offenders, offenders


@pytest.mark.parametrize("module", ["pdserve.cli", "pdserve.deploy.launch", "pdserve.router.serve", "pdserve.api.serve",
                                    "pdserve.engine.__main__", "pdserve.disagg.cache_service", "pdserve"])
def test_entry_points_import_without_torch(module: str):
    code = f"import sys, importlib; importlib.import_module({module!r}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
