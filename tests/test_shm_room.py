"""A cache that /dev/shm could not hold filled is refused at startup with a message, not left to kill
the process with SIGBUS mid-request; caches are sized from the room other instances leave."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.deploy import plan
from pdserve.utils import shm_room
from tests.servers import free_port, segments

MiB, GiB = 1 << 20, 1 << 30


def _promise(folder: Path, name: str, size: int, filled: int = 0) -> Path:
    path = folder / name
    with open(path, "wb") as f:
        f.truncate(size)  # sparse, as a new segment
        f.write(b"\1" * filled)
        f.flush()
        os.fsync(f.fileno())
    return path


def test_room_is_the_free_space_less_what_pdserve_segments_may_still_fill(tmp_path: Path) -> None:
    free = shm_room.shm_room(tmp_path)
    _promise(tmp_path, "pdserve-kv-1-aaaa", 64 * MiB)
    _promise(tmp_path, "pdserve-kv-2-bbbb", 32 * MiB, filled=8 * MiB)
    _promise(tmp_path, "someone-else", 64 * MiB)  # not ours: not counted
    assert shm_room.unfilled(tmp_path) == 64 * MiB + 24 * MiB
    assert abs(shm_room.shm_room(tmp_path) - (free - 88 * MiB)) < 16 * MiB  # the 8 MiB written, other files


def test_a_segment_larger_than_the_room_is_refused_naming_the_flags(tmp_path: Path) -> None:
    _promise(tmp_path, "pdserve-kv-1-aaaa", shm_room.shm_room(tmp_path) + GiB)  # promised more than there is
    assert shm_room.shm_room(tmp_path) == 0
    with pytest.raises(shm_room.SharedMemoryFull, match="--kv-cache-memory.*--shm-size"):
        shm_room.check_room(MiB, tmp_path)
    shm_room.check_room(0, tmp_path)


def test_launch_shares_the_free_memory_among_instances_unless_a_flag_sizes_them(monkeypatch) -> None:
    monkeypatch.setattr(plan, "cpu_only", lambda: True)
    monkeypatch.setattr(plan, "free_host_memory", lambda: 12 * GiB)
    assert plan.memory_shares([], 3) == ["--kv-cache-memory", str(4 * GiB)]
    assert plan.memory_shares(["--kv-cache-memory", "2G"], 3) == []
    assert plan.memory_shares(["--num-gpu-blocks-override=200"], 3) == []
    monkeypatch.setattr(plan, "cpu_only", lambda: False)  # a GPU's cache is sized from the GPU
    assert plan.memory_shares([], 3) == []


@pytest.mark.e2e
@pytest.mark.parametrize("role, flags", [
    ("mixed", lambda room: ["--kv-cache-memory", str(2 * room + 4 * GiB)]),  # the worker creates the cache
    ("prefill", lambda room: ["--num-gpu-blocks-override", "64", "--swap-space", str((room + 4 * GiB) / 1e9)]),
])
def test_a_cache_dev_shm_cannot_hold_exits_2_with_a_message(role, flags) -> None:
    room = shm_room.shm_room()
    if room is None:
        pytest.skip("no /dev/shm")
    before = segments()
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--splitwise-role", role, "--port",
                          str(free_port()), "--max-model-len", "256", *flags(room)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "shared-memory segment does not fit" in out.stderr and "--shm-size" in out.stderr, out.stderr
    assert segments() <= before, f"segments left behind: {segments() - before}"


def _startup(monkeypatch, room_blocks: int, **config):  # noqa: ANN202
    from pdserve.config.engine import EngineConfig
    from pdserve.instance import startup
    from pdserve.kv.layout import KVLayout

    layout = KVLayout(num_blocks=1000, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
    monkeypatch.setattr(startup, "shm_room", lambda: room_blocks * layout.block_bytes)
    slog = startup.StartupLog(None, (), startup.Row(True, False, True, True))
    start = startup._Startup(EngineConfig(**config), None, "", slog, True)
    start.layout = layout
    start._size_host_memory()
    return start


def test_a_profiled_device_cache_gets_no_more_blocks_than_its_staging_can_hold(monkeypatch) -> None:
    gb = lambda blocks: blocks * 1536 / 2**30  # noqa: E731 - this layout's block is 1,536 bytes
    start = _startup(monkeypatch, 300, splitwise_role="prefill", swap_space=gb(100))
    start._fit_staging_in_host_memory()
    assert start.layout.num_blocks == 200  # the host tier's 100 blocks share the room
    roomy = _startup(monkeypatch, 5000, splitwise_role="decode")
    roomy._fit_staging_in_host_memory()
    assert roomy.layout.num_blocks == 1000  # fits: as profiled
