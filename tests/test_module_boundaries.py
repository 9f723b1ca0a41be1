"""Imports that must run one way. Packages form the layers listed in docs/architecture.md ("Layers"): a package
imports only packages of lower layers, counting every import (top level, in functions, under TYPE_CHECKING;
the entry points `__main__.py` and `cli.py` compose and are exempt), so neither packages nor modules import in a
cycle. Beside that: the router and the API server share `pdserve.http`, never each other; `pdserve.disagg`
implements the engine's connector contract (engine/kv_connector.py) and the engine never imports it back
(pdserve.instance wires them); processes that do not compute never import torch at module level (checked on live
processes in test_launch.py)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
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
    offenders = {f"{p.relative_to(PKG)}: {m}" for p in (PKG / "engine").rglob("*.py") for m in _imports(p)
                 if m == "pdserve.disagg" or m.startswith("pdserve.disagg.")}
    assert not offenders, offenders


@pytest.mark.parametrize("module", ["pdserve.cli", "pdserve.deploy.launch", "pdserve.router.serve", "pdserve.api.serve",
                                    "pdserve.instance.engine_process", "pdserve.disagg.cache_service", "pdserve"])
def test_entry_points_import_without_torch(module: str):
    code = f"import sys, importlib; importlib.import_module({module!r}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


ENTRY_POINTS = {"__main__.py", "cli.py"}
ARCHITECTURE = PKG.parent / "docs" / "architecture.md"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _resolved(name: str) -> str | None:
    """The pdserve module an import names (a name imported from a module resolves to that module); None for a
    package without __init__.py, which runs nothing."""
    while name not in MODULES:
        if name.count(".") <= 1:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def _packages() -> set[str]:
    return {p.name for p in PKG.iterdir() if p.is_dir() and any(p.glob("*.py"))}


def _module_imports(path: Path) -> Iterator[str]:
    """Every pdserve module `path` imports, wherever the import statement is."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = _module_name(path).split(".")[: -1 if path.name != "__init__.py" else None]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("pdserve") and (target := _resolved(name)) is not None:
                yield target


def _module_graph() -> dict[str, set[str]]:
    return {name: {t for t in _module_imports(path) if MODULES[t].name not in ENTRY_POINTS and t != name}
            for name, path in MODULES.items() if path.name not in ENTRY_POINTS}


def _package(module: str) -> str:
    """A module's package: its folder under pdserve/, or `pdserve` for the package's own __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in _packages()) else "pdserve"


def _documented_layers() -> list[set[str]]:
    """The "Layers" list of docs/architecture.md, lowest first: one numbered line per layer, its packages in
    backticks before the colon."""
    text = ARCHITECTURE.read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    return [set(re.findall(r"`([a-z_]+)`", line.split(":")[0])) for line in section.splitlines()
            if re.match(r"\d+\. ", line)]


def _cycle_edge(graph: dict[str, set[str]]) -> tuple[str, str] | None:
    """An edge that closes a cycle (depth-first search), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str) -> tuple[str, str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return node, nxt
            if nxt not in state and (edge := visit(nxt)):
                return edge
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (edge := visit(node)):
            return edge
    return None


def test_every_package_is_in_one_documented_layer():
    layers = _documented_layers()
    listed = [p for layer in layers for p in layer]
    assert len(listed) == len(set(listed)), f"a package is in two layers: {sorted(listed)}"
    actual = _packages() | {"pdserve"}
    assert set(listed) == actual, f"undocumented: {sorted(actual - set(listed))}, gone: {sorted(set(listed) - actual)}"


def test_packages_import_only_lower_layers():
    layer_of = {p: i for i, layer in enumerate(_documented_layers()) for p in layer}
    offenders = sorted(f"{a} -> {b} ({_package(a)} is layer {layer_of[_package(a)] + 1}, {_package(b)} is "
                       f"layer {layer_of[_package(b)] + 1})"
                       for a, targets in _module_graph().items() for b in targets
                       if _package(a) != _package(b) and layer_of[_package(b)] >= layer_of[_package(a)])
    assert not offenders, "\n".join(offenders)


def test_no_package_imports_in_a_cycle():
    packages: dict[str, set[str]] = {}
    for a, targets in _module_graph().items():
        packages.setdefault(_package(a), set()).update(_package(b) for b in targets if _package(b) != _package(a))
    assert _cycle_edge(packages) is None, f"this import closes a package cycle: {_cycle_edge(packages)}"


def test_no_module_imports_in_a_cycle():
    graph = _module_graph()
    assert _cycle_edge(graph) is None, f"this import closes a module cycle: {_cycle_edge(graph)}"


def test_the_cycle_finder_names_the_closing_edge():
    assert _cycle_edge({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ("c", "a")
    assert _cycle_edge({"a": {"b"}, "b": {"c"}, "c": set()}) is None
