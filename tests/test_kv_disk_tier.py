"""The disk tier end to end (`--kv-disk-path`, issue 55): a server stopped right after an answer and restarted on the
same folder serves the prompt's prefix from disk (counted as cached, the answer equal to the cold run's), with the
cache in shared memory or in the worker's own memory (the CUDA path, run on CPU; there with an fp8 cache); a damaged
file is a miss, never served (the answer still equal, the block computed); a server with another KV dtype on the
same folder never reads them. The flag without --swap-space exits 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.greedy import assert_same_greedy_completion
from tests.servers import Server, metrics, segments, stop_all, wait_for
from tests.test_swap_space import COMMON, _prompts

pytestmark = pytest.mark.e2e  # starts pdserve processes


def _server(tmp_path: Path, name: str, disk: Path, *extra: str, env: dict[str, str] | None = None) -> Server:
    s = Server(tmp_path / name, *COMMON, "--swap-space", "0.05", "--kv-disk-path", str(disk), *extra, wait=False,
               env=env)
    s.wait_ready(240)
    return s


def _complete(url: str, prompt: list[int]) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    return client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8, temperature=0,
                                     logprobs=2)


def _block_files(disk: Path) -> list[Path]:
    return sorted(disk.glob("*/*.kvb"))


def test_a_restarted_server_serves_prefixes_from_disk_and_never_a_damaged_block(tmp_path: Path) -> None:
    before = segments()
    disk = tmp_path / "kv"
    a = _prompts()[0]
    first = _server(tmp_path, "first", disk, "--dtype", "float32")
    try:
        cold = _complete(first.url, a)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        stop_all([first])  # at once: a clean stop finishes the writes (and makes those not yet made)
    files = _block_files(disk)
    assert len(files) == 6 and len({f.parent for f in files}) == 1  # the 96-token prompt: 6 blocks, one folder
    assert "ordered written at stop" in first.log()

    again = _server(tmp_path, "again", disk, "--dtype", "float32")
    try:
        warm = _complete(again.url, a)
        assert warm.usage.prompt_tokens_details.cached_tokens == 80  # 5 full blocks from disk; the 6th computed
        assert_same_greedy_completion(warm, cold, "the prompt served from disk after a restart")
        wait_for(lambda: metrics(again.metrics_port).get("pdserve_disk_cache_hit_blocks_total") == 5, 10,
                 "the disk tier's hits were not counted")
    finally:
        stop_all([again])

    for f in _block_files(disk):  # every block damaged: one flipped byte each
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    damaged = _server(tmp_path, "damaged", disk, "--dtype", "float32")
    try:
        answer = _complete(damaged.url, a)
        assert answer.usage.prompt_tokens_details.cached_tokens == 0  # nothing served from a damaged file
        assert_same_greedy_completion(answer, cold, "the prompt after its disk blocks were damaged")
        wait_for(lambda: metrics(damaged.metrics_port).get("pdserve_disk_cache_misses_total") == 5, 10,
                 "the damaged blocks were not counted")  # the prompt's 5 full blocks, each read and refused
        assert "is damaged (truncated or corrupt)" in damaged.log()
    finally:
        stop_all([damaged])

    other = _server(tmp_path, "other", disk, "--dtype", "bfloat16")  # another KV dtype: another folder
    try:
        _complete(other.url, a)
        _complete(other.url, a)  # the second finds the first in the device cache, never on disk
        assert metrics(other.metrics_port)["pdserve_disk_cache_hit_blocks_total"] == 0
    finally:
        stop_all([other])
    assert len({f.parent for f in _block_files(disk)}) == 2
    assert segments() <= before, f"left behind: {segments() - before}"


def test_the_disk_tier_with_an_fp8_cache_in_the_workers_own_memory(tmp_path: Path) -> None:
    """8-bit blocks (codes and scales) go to disk and come back through the worker's copies after a restart."""
    from pdserve.instance.startup import PRIVATE_CACHE_ENV

    before = segments()
    disk, private = tmp_path / "kv", {PRIVATE_CACHE_ENV: "1"}
    a = _prompts()[1]
    fp8 = ("--dtype", "float32", "--kv-cache-dtype", "fp8")
    first = _server(tmp_path, "first", disk, *fp8, env=private)
    try:
        cold = _complete(first.url, a)
    finally:
        stop_all([first])
    assert len(_block_files(disk)) == 6
    assert all(f.stat().st_size < 0.3 * 30 * 16 * 3 * 64 * 2 * 4 for f in _block_files(disk))  # fp32's: 0.26x
    again = _server(tmp_path, "again", disk, *fp8, env=private)
    try:
        warm = _complete(again.url, a)
        assert warm.usage.prompt_tokens_details.cached_tokens == 80
        assert_same_greedy_completion(warm, cold, "the prompt served from disk through the worker's copies")
    finally:
        stop_all([again])
    assert segments() <= before, f"left behind: {segments() - before}"


def test_kv_disk_path_without_swap_space_exits_2(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--kv-disk-path", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--kv-disk-path" in out.stderr and "--swap-space" in out.stderr
