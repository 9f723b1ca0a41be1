"""A server's ports are taken before its engine loads: a port in use fails at once, naming the port."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.servers import free_port

pytestmark = pytest.mark.e2e  # starts a pdserve process


@pytest.mark.parametrize("which", ["--port", "--metrics-port"])
def test_a_port_in_use_exits_2_before_the_engine_starts(which: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = "--metrics-port" if which == "--port" else "--port"
        out = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", which, str(port), other, str(free_port())],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"could not listen on 127.0.0.1:{port} (is the port in use?)" in out.stderr
    assert "startup: plan" not in out.stderr, "the engine was started although the server could not listen"
