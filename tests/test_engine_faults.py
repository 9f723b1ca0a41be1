"""A dead worker or engine process ends requests with a clear error, never a hang, and leaks no cache."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import psutil
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.engine_client import EngineError

pytestmark = pytest.mark.e2e  # starts pdserve processes or loads the model: not in `make test-fast`


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("*pdserve*")}


def _ipc_folders() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("pdserve-*")}


def _wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("victim", ["worker", "cache_service", "engine"])
def test_killed_process_fails_requests_and_cleans_up(victim):
    before, folders_before = _segments(), _ipc_folders()
    llm = LLM(num_gpu_blocks_override=32, block_size=16, max_model_len=512)
    try:
        engine = psutil.Process(llm.engine.proc.pid)
        children = {("worker" if "pdserve.worker" in p.cmdline() else "cache_service"): p for p in engine.children()}
        assert set(children) == {"worker", "cache_service"}  # mixed role, prefix cache on: both (startup table)
        assert len(_segments() - before) == 1
        {**children, "engine": engine}[victim].kill()
        start = time.monotonic()
        with pytest.raises(EngineError, match="exited|died"):
            llm.generate("Hello", SamplingParams(max_tokens=8), use_tqdm=False)
        assert time.monotonic() - start < 10
        pids = [engine.pid, *(p.pid for p in children.values())]
        assert _wait_gone(pids), "a child process outlived the failure"
        deadline = time.monotonic() + 10
        while _segments() - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _segments() - before == set(), "the KV cache segment was left behind"
    finally:
        llm.close()
    assert _ipc_folders() - folders_before == set(), "a socket folder outlived its processes"
