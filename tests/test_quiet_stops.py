"""Stopping is quiet and complete (issue 26): Ctrl-C reaches a whole process group, at any moment,
startup included; each pdserve process says one line, prints no traceback and exits 130; nothing is
left. A server process killed with SIGKILL takes its engine, worker and cache service with it
within 5 s, and leaves no KV segment and no IPC folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.servers import REPO, free_port, segments, wait_for

pytestmark = pytest.mark.e2e  # starts pdserve processes or loads the model: not in `make test-fast`

SMALL = ["--max-model-len", "512", "--num-gpu-blocks-override", "64"]


def _start(tmp: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    log = tmp / "out.log"
    with open(log, "wb") as out:  # its own session and process group, as a terminal gives a command
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(tmp)},
                                start_new_session=True)
    return proc, log


def _session(sid: int) -> list[psutil.Process]:
    alive = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


def _ready(log: Path) -> bool:
    return "pdserve: serving" in log.read_text(errors="replace") or "pdserve: router on" in log.read_text(
        errors="replace")


COMMANDS = {
    "prefill": ["serve", "--splitwise-role", "prefill", *SMALL],
    "decode": ["serve", "--splitwise-role", "decode", *SMALL],
    "router": ["router", "--tokenizer", "none"],
}


@pytest.mark.parametrize(("role", "moment"), [("prefill", "startup"), ("decode", "serving"), ("router", "serving")])
def test_ctrl_c_to_the_group_stops_every_process_quietly(tmp_path: Path, role: str, moment: str) -> None:
    before = segments()
    proc, log = _start(tmp_path, *COMMANDS[role], "--port", str(free_port()))
    if moment == "startup":  # the worker is loading the model, the engine waits for it
        wait_for(lambda: len(_session(proc.pid)) >= 3, 60, "the children did not start")
    else:
        wait_for(lambda: _ready(log) or proc.poll() is not None, 180, "it did not start serving")
    os.killpg(proc.pid, signal.SIGINT)
    asked = time.monotonic()
    assert proc.wait(30) == 130, log.read_text()
    assert time.monotonic() - asked < 10, "a stop during startup waited for the startup to finish"
    wait_for(lambda: not _session(proc.pid), 10, f"processes outlived Ctrl-C: {_session(proc.pid)}")
    out = log.read_text(errors="replace")
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert out.count("stopped (SIGINT)") == 1, out
    assert segments() <= before, "a KV segment was left behind"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("pdserve-")], "an IPC folder was left behind"


def test_a_killed_server_takes_its_children_within_5_s_and_leaves_nothing(tmp_path: Path) -> None:
    before = segments()
    proc, log = _start(tmp_path, *COMMANDS["prefill"], "--port", str(free_port()))
    try:
        wait_for(lambda: _ready(log) or proc.poll() is not None, 180, "it did not start serving")
        children = psutil.Process(proc.pid).children(recursive=True)
        names = {" ".join(c.cmdline()[2:3]) for c in children}
        assert {"pdserve.instance.engine_process", "pdserve.worker", "pdserve.disagg.cache_service"} <= names, names
        proc.kill()
        killed = time.monotonic()
        wait_for(lambda: not _session(proc.pid), 5, "children outlived their server by 5 s")
        assert time.monotonic() - killed < 5
        wait_for(lambda: segments() <= before, 2, "a KV segment was left behind")
        wait_for(lambda: not [p for p in tmp_path.iterdir() if p.name.startswith("pdserve-")], 5,
                 "an IPC folder was left behind")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
