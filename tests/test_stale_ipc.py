"""A pdserve process killed with SIGKILL (whole process group: no cleanup ran) leaves its IPC folder and
KV segment; the next engine start on the machine removes them, and never a live process's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.utils.stale_ipc import sweep_stale
from tests.servers import REPO

pytestmark = pytest.mark.e2e  # starts pdserve processes or loads the model: not in `make test-fast`

START = ("from pdserve import LLM\n"
         "llm = LLM(num_gpu_blocks_override=16, max_model_len=256, block_size=16)\n"
         "print('up', flush=True)\n"
         "input()\n"  # until told to stop
         "llm.close()\n")


def _run_llm(tmp: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", START], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True,
                            env={**os.environ, "TMPDIR": str(tmp)}, start_new_session=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def _segments_of(pids: set[int]) -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("pdserve-kv-*") if int(p.name.split("-")[2]) in pids}


def _tree(pid: int) -> set[int]:
    import psutil

    return {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}


def test_next_start_sweeps_what_a_killed_instance_left(tmp_path: Path):
    killed = _run_llm(tmp_path)
    pids = _tree(killed.pid)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(f"pdserve-{killed.pid}-")]
    assert left and _segments_of(pids), "SIGKILL left nothing behind to sweep (the premise of this test)"

    survivor = _run_llm(tmp_path)  # its engine start sweeps
    try:
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f"pdserve-{killed.pid}-")]
        assert not _segments_of(pids)
        assert [p for p in tmp_path.iterdir() if p.name.startswith(f"pdserve-{survivor.pid}-")]
        assert _segments_of(_tree(survivor.pid)), "a live instance's segment must stay"
        assert sweep_stale(tmp_path) == []  # nothing of the live one is stale
    finally:
        survivor.communicate("\n", timeout=30)
    assert survivor.returncode == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("pdserve-")]
