"""pdserve processes for end-to-end tests: `pdserve serve` / `router` in subprocesses, each with its own
TMPDIR and log, stopped with SIGTERM and checked to leave no process, shared-memory segment or IPC
directory behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("*pdserve*")}


class CliProcess:
    """`python -m pdserve.cli ARGS` in a subprocess; waits until `ready()` is true."""

    def __init__(self, workdir: Path, args: list[str], port: int, start_timeout: float = 120,
                 wait: bool = True, host: str = "127.0.0.1", env: dict[str, str] | None = None) -> None:
        self.port, self.host = port, host
        workdir.mkdir(parents=True, exist_ok=True)
        self.tmpdir = workdir / "tmp"
        self.tmpdir.mkdir(exist_ok=True)
        self.log_path = workdir / "process.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], cwd=REPO, stdout=log,
                                         stderr=subprocess.STDOUT,
                                         env={**os.environ, "TMPDIR": str(self.tmpdir), **(env or {})})
        self.pids: set[int] = {self.proc.pid}
        self._terminated = False
        if wait:
            self.wait_ready(start_timeout)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{self} exited (code {self.proc.returncode}) while starting:\n{self.log()}")
            if self.ready():
                self.pids |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
                return
            time.sleep(0.25)
        pytest.fail(f"{self} was not ready within {timeout} s:\n{self.log()}")

    def own_segments(self) -> set[str]:
        """/dev/shm segments named after one of this process tree's processes (pdserve-kv-PID-...)."""
        out = set()
        for name in segments():
            m = re.search(r"pdserve-kv-(\d+)-", name)
            if m and int(m.group(1)) in self.pids:
                out.add(name)
        return out

    def children(self, module: str) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True) if module in " ".join(p.cmdline())]

    def kill(self) -> None:
        """SIGKILL the top process (its children notice and exit), as a crashed host would."""
        self.proc.kill()
        self.proc.wait()

    def wait_gone(self, timeout: float = 20) -> None:
        """Every process of the tree exits and the segments go."""
        deadline = time.monotonic() + timeout
        alive: list[int] = []
        while time.monotonic() < deadline:
            alive = [p for p in self.pids if psutil.pid_exists(p)
                     and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
            if not alive and not self.own_segments():
                break
            time.sleep(0.1)
        assert not alive, f"processes of {self} outlived it: {alive}\n{self.log()}"
        assert not self.own_segments(), f"KV cache segments left in /dev/shm: {self.own_segments()}"

    def terminate(self) -> None:
        """SIGTERM, once (a second one would cut the graceful shutdown short)."""
        if self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self) -> None:
        """SIGTERM; it must exit within 20 s and leave nothing behind."""
        self.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            stuck = []  # which process of the tree hung, for whoever reads the failure
            for p in [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]:
                try:
                    stuck.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:120]}")
                except psutil.Error:
                    pass
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                p.kill()
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"{self} did not exit within 20 s of SIGTERM; still running:\n" + "\n".join(stuck)
                        + f"\n{self.log()}")
        assert self.proc.returncode in (0, 128 + signal.SIGTERM, -signal.SIGTERM), (
            f"{self} exited with code {self.proc.returncode} on SIGTERM:\n{self.log()}")
        assert "Traceback" not in self.log(), f"tracebacks while stopping {self}:\n{self.log()}"
        self.wait_gone(10)
        # Its own only (pdserve-<pid>-*, after a process of its tree): a fixture may give several servers one
        # workdir, and stop_all stops them side by side, so another's may still be on its way out.
        left = sorted(p.name for p in self.tmpdir.iterdir() if p.name.startswith("pdserve-")
                      and p.name.split("-")[1].isdigit() and int(p.name.split("-")[1]) in self.pids)
        assert not left, f"IPC directories left in TMPDIR: {left}\n{self.log()}"


class Server(CliProcess):
    """`pdserve serve` (any role)."""

    def __init__(self, workdir: Path, *extra: str, wait: bool = True, host: str = "127.0.0.1",
                 port: int | None = None, metrics_port: int | None = None, env: dict[str, str] | None = None) -> None:
        self.metrics_port = metrics_port or free_port(host)
        port = port or free_port(host)
        super().__init__(workdir, ["serve", "--host", host, "--port", str(port), "--metrics-port",
                                   str(self.metrics_port), "--block-size", str(BLOCK), *extra], port, wait=wait,
                         host=host, env=env)
        if wait:
            assert self.own_segments(), "no KV cache segment of this server found in /dev/shm"

    def __str__(self) -> str:
        return f"the server on port {self.port}"

    def engine(self) -> psutil.Process:
        (engine,) = self.children("pdserve.instance.engine_process")
        return engine

    def worker(self) -> psutil.Process:
        (worker,) = [p for p in self.engine().children() if "pdserve.worker" in p.cmdline()]
        return worker


class Router(CliProcess):
    def __init__(self, workdir: Path, *extra: str) -> None:
        port = free_port()
        super().__init__(workdir, ["router", "--port", str(port), *extra], port)

    def __str__(self) -> str:
        return f"the router on port {self.port}"

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/instances", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def registered(self) -> list[dict]:
        return httpx.get(f"{self.url}/registered", timeout=5).json()["instances"]

    def healthy_urls(self) -> set[str]:
        return {i["url"] for i in self.registered() if i["healthy"]}

    def wait_pairs(self, expected: int, timeout: float = 30) -> None:
        """Until `expected` instances are registered and healthy, and /health is 200."""
        wait_for(lambda: len(self.healthy_urls()) >= expected
                 and httpx.get(f"{self.url}/health", timeout=2).status_code == 200, timeout,
                 f"{expected} instances did not register with the router and pass its health checks")


def metrics(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over labels, and 'name{labels}': value}."""
    r = httpx.get(f"http://{host}:{port}/metrics", timeout=10)
    assert r.status_code == 200
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
            if name != name_labels:
                out[name_labels] = float(value)
    return out


def wait_for(predicate, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout} s")
        time.sleep(0.2)


def register(router_url: str, info: dict, secret: bytes = b"", path: str = "/register") -> httpx.Response:
    """POST /register (or /unregister) as an instance does, signed with `secret`."""
    import json

    from pdserve.utils.cluster_auth import SIGNATURE_HEADER, sign_body

    body = json.dumps(info).encode()
    return httpx.post(f"{router_url}{path}", content=body, timeout=10,
                      headers={"Content-Type": "application/json", SIGNATURE_HEADER: sign_body(secret, path, body)})


class BrokenInstance:
    """An instance that passes health checks but drops every request's connection unanswered, as a
    process that dies mid-request would."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:  # noqa: N802
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def stop_all(processes: list[CliProcess]) -> None:
    """Stop every process, even when stopping one fails its checks; then report the first failure. All are told
    at once, so they shut down side by side."""
    failures: list[BaseException] = []
    for p in processes:
        p.terminate()
    for p in processes:
        try:
            p.stop()
        except BaseException as e:  # pytest.fail raises an OutcomeException, not an Exception
            failures.append(e)
    if failures:
        raise failures[0]
