"""An engine's IPC sockets need a short folder: a socket's path has at most 107 characters (AF_UNIX), and a deep
TMPDIR (a test runner's, a job scheduler's) left no room, so the engine failed at its first bind."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import zmq

from pdserve.utils.stale_ipc import SOCKET_PATH_MAX, make_ipc_folder, sweep_stale


@pytest.fixture
def deep_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    return deep


def _bind(path: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    try:
        sock.bind(f"ipc://{path}")
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_deep_temp_folder_puts_the_sockets_in_tmp_and_they_bind(deep_tmpdir: Path) -> None:
    with pytest.raises(zmq.ZMQError):  # the premise: in the deep folder the engine's worker socket cannot bind
        _bind(str(deep_tmpdir / "pdserve-1-abcdefgh" / "engine" / "w"))
    folder = Path(make_ipc_folder(os.getpid()))
    try:
        assert folder.parent == Path("/tmp") and folder.name.startswith(f"pdserve-{os.getpid()}-")
        (folder / "engine").mkdir()
        longest = folder / "engine" / "w.ranks"
        assert len(str(longest)) <= SOCKET_PATH_MAX
        _bind(str(longest))
    finally:
        shutil.rmtree(folder)


def test_what_a_killed_process_left_in_tmp_is_swept_too(deep_tmpdir: Path) -> None:
    dead = Path(tempfile.mkdtemp(prefix="pdserve-999999999-", dir="/tmp"))  # no such pid
    assert dead.name in sweep_stale(shm_dir=deep_tmpdir)
    assert not dead.exists()
