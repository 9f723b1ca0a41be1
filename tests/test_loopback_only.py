"""Tests and benchmarks talk to 127.0.0.0/8 and [::1] only.

Two guards: the session runs in a network namespace with only `lo` (tests/loopback_only.py), so a stray
connection fails; and a scan of tests/ and bench/ refuses the things that stray: a Ray cluster or `ray.init`
without a loopback node address (Ray then takes the machine's outward one), a bind to every interface
(`0.0.0.0`, `tcp://*`), a host other than loopback in a URL or an address, and the machine's own name or
address asked for. A literal that names another host but is never contacted (a flag parsed, an id) carries
the words `not contacted` in a comment on its line.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

from tests.conftest import NETWORK
from tests.loopback_only import outward_address_reachable

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "bench")
MARKER = "not contacted"
LOOPBACK = re.compile(r"^(127(\.\d{1,3}){3}|localhost|::1|\[::1\])$")
URL_HOST = re.compile(r"\b([a-z][a-z0-9+.-]*)://(\[[^\]]*\]|[^/\s:'\"{}\[\]\\]+)")
IPV4 = re.compile(r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(?![\d.])")
LOCAL_SCHEMES = {"ipc", "inproc", "file", "unix"}
ALL_INTERFACES = re.compile(r"(?<![\d.])0\.0\.0\.0(?![\d.])|tcp://\*|\[::\]")
RAY_START = re.compile(r"\bray start\b")
RAY_START_LOOPBACK = re.compile(r"--node-ip-address[= ](127(\.\d{1,3}){3}|localhost)\b")
OWN_ADDRESS_CALLS = {"gethostname", "gethostbyname", "getfqdn", "get_node_ip_address"}


def violations(source: str, name: str = "<source>") -> list[str]:
    """What in a Python file may send traffic off loopback, each as `name:line: why`."""
    lines = source.splitlines()
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            found += _ray_call(node) + _own_address_call(node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if MARKER not in "\n".join(lines[node.lineno - 1:node.end_lineno]):
                found += [(node.lineno, why) for why in _literal(node.value)]
    return [f"{name}:{line}: {why}" for line, why in sorted(set(found))]


def _literal(text: str) -> list[str]:
    out = []
    if ALL_INTERFACES.search(text) or text == "::":
        out.append(f"binds to every interface: {text[:60]!r}")
    for scheme, host in URL_HOST.findall(text):
        if scheme not in LOCAL_SCHEMES and host != "*" and not LOOPBACK.match(host):
            out.append(f"talks to {host!r}, not loopback")
    for ip in IPV4.findall(text):
        if ip != "0.0.0.0" and not LOOPBACK.match(ip):
            out.append(f"names {ip}, not loopback")
    if RAY_START.search(text) and not RAY_START_LOOPBACK.search(text):
        out.append("`ray start` without --node-ip-address 127.0.0.1: Ray takes the outward address")
    return out


def _ray_call(call: ast.Call) -> list[tuple[int, str]]:
    name = _called(call)
    short = name.rsplit(".", 1)[-1]
    if short == "Cluster":
        head = next((k.value for k in call.keywords if k.arg == "head_node_args"), None)
        head_ip = _dict_value(head, "node_ip_address") if isinstance(head, ast.Dict) else None
        if not _is_loopback(head_ip):
            return [(call.lineno, "a Ray Cluster whose head_node_args lack node_ip_address='127.0.0.1'")]
    elif short == "add_node" and not _is_loopback(_keyword(call, "node_ip_address")):
        return [(call.lineno, "a Ray node added without node_ip_address='127.0.0.1'")]
    elif name == "ray.init" and not _is_loopback(_keyword(call, "_node_ip_address")):
        return [(call.lineno, "ray.init without _node_ip_address='127.0.0.1'")]
    return []


def _own_address_call(call: ast.Call) -> list[tuple[int, str]]:
    name = _called(call).rsplit(".", 1)[-1]
    return [(call.lineno, f"{name}() asks for this machine's own name or address")] if name in OWN_ADDRESS_CALLS \
        else []


def _called(call: ast.Call) -> str:
    try:
        return ast.unparse(call.func)
    except ValueError:
        return ""


def _keyword(call: ast.Call, arg: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == arg), None)


def _dict_value(d: ast.Dict, key: str) -> ast.expr | None:
    return next((v for k, v in zip(d.keys, d.values, strict=True)
                 if isinstance(k, ast.Constant) and k.value == key), None)


def _is_loopback(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Constant) and isinstance(value.value, str) and bool(LOOPBACK.match(value.value))


def scanned_files() -> list[Path]:
    me = Path(__file__).resolve()
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh") and p != me)


def test_tests_and_benchmarks_stay_on_loopback() -> None:
    found = []
    for path in scanned_files():
        text, name = path.read_text(), str(path.relative_to(ROOT))
        if path.suffix == ".py":
            found += violations(text, name)
        else:
            found += [f"{name}: {why}" for line in text.splitlines() if MARKER not in line for why in _literal(line)]
    assert len(scanned_files()) > 50
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("source", "why"), [
    ("from ray.cluster_utils import Cluster\nc = Cluster(initialize_head=True, head_node_args={'num_cpus': 1})",
     "a Ray Cluster whose head_node_args lack node_ip_address"),
    ("c.add_node(num_cpus=1, resources={'decode': 1})", "a Ray node added without node_ip_address"),
    ("c.add_node(num_cpus=1, node_ip_address='10.1.2.3')", "a Ray node added without node_ip_address"),
    ("import ray\nray.init(address='127.0.0.1:6379')", "ray.init without _node_ip_address"),
    ("cmd = 'ray start --head --num-cpus 2'", "`ray start` without --node-ip-address"),
    ("args = ['serve', '--host', '0.0.0.0']", "binds to every interface"),
    ("endpoint = 'tcp://*:5557'", "binds to every interface"),
    ("url = f'http://example.com:{port}/v1'", "talks to 'example.com'"),
    ("url = 'http://192.0.2.2:8000'", "talks to '192.0.2.2'"),
    ("import socket\nhost = socket.gethostbyname(socket.gethostname())", "asks for this machine's own name"),
])
def test_the_scan_refuses_what_would_leave_loopback(source: str, why: str) -> None:
    found = violations(textwrap.dedent(source))
    assert any(why in v for v in found), found


def test_the_scan_lets_loopback_clusters_and_marked_literals_pass() -> None:
    source = textwrap.dedent("""
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"})
        c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        cmd = "ray start --head --node-ip-address 127.0.0.1"
        urls = ["http://127.0.0.2:8000", "http://localhost:1", "http://[::1]:2", "ipc:///tmp/x", "inproc://y"]
        parsed = parse("--router 10.0.0.5:8000")  # not contacted
    """)
    assert violations(source) == []


def test_the_session_cannot_reach_past_loopback() -> None:
    if "only lo" not in NETWORK:
        pytest.skip(f"this session runs on {NETWORK}")
    assert not outward_address_reachable()
