"""Prefix pulls as the engine's KV cache manager runs them (copies simulated with arrays; the peer a dict of
hashes): a hint's run past the local hits is pulled into host blocks and then into the device cache, counted as
tier "pulled"; a partial answer brings the leading blocks and the rest is computed; no answer keeps those host
blocks out of use until a late write could no longer land; computing wins when it is cheaper. The cache service's
index of host blocks follows every overwrite, and a router's index finds the peer with the longest run."""

from __future__ import annotations

import time

import pytest

from pdserve.disagg.block_server import HostBlockIndex
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.prefix_loads import LoadResult
from pdserve.engine.prefix_pull import PullCost, PullHint
from pdserve.engine.request import Request
from pdserve.kv_events.events import BlockStored
from pdserve.kv_events.index import KVIndex
from pdserve.sampling import SamplingParams
from tests.test_disk_tier import BS, ArrayCopier, admit, run

PROMPT = list(range(1, 18))  # 4 full blocks + 1 token


class PullingCopier(ArrayCopier):
    """A peer holding `peer` (hash -> content); `answer`: how many blocks it writes (None: it never answers)."""

    def __init__(self, device_blocks: int, host_blocks: int) -> None:
        super().__init__(device_blocks, host_blocks)
        self.peer: dict[bytes, float] = {}
        self.answer: int | None = 99
        self.asked: list[list[bytes]] = []
        self.answers: list[LoadResult] = []

    def start_pull(self, load_id, addr, hashes, host_blocks, deadline):  # noqa: ANN001, ANN201
        self.asked.append(list(hashes))
        if self.answer is None:
            return
        n = 0
        for h, b in zip(hashes[:self.answer], host_blocks, strict=False):
            if h not in self.peer:
                break
            self.host[b] = self.peer[h]
            n += 1
        self.answers.append(LoadResult(load_id, [True] * n, n * 100, seconds=0.01 * n))  # the holder's write time

    def loads_done(self) -> list[LoadResult]:
        out, self.answers = super().loads_done() + self.answers, []
        return out

    def forget_host_blocks(self) -> None:
        pass


def pulling(host_blocks: int = 8, prefill_rate: float = 1e3) -> tuple[KVCacheManager, PullingCopier]:
    kv = KVCacheManager(8, BS)
    copier = PullingCopier(8, host_blocks)
    kv.add_host_tier(host_blocks, copier)
    kv.add_prefix_pulls(PullCost(block_bytes=100, block_size=BS, prefill_rate=lambda: prefill_rate))
    return kv, copier


def the_peer_computed(copier: PullingCopier) -> list[float]:
    """The peer's cache holds PROMPT's blocks (computed by another manager: the same hashes and contents)."""
    other, other_copier = pulling()
    req, _, contents = admit(other, other_copier, PROMPT)
    copier.peer = dict(zip(req.block_hashes, contents, strict=False))
    return contents


def hinted(kv: KVCacheManager, copier: PullingCopier, blocks: int = 4) -> tuple[int, list[float], Request]:
    """PROMPT admitted with a router's hint that the peer holds `blocks`; (cached blocks, their contents, it)."""
    req = Request("r", PROMPT, SamplingParams(max_tokens=1), kv_pull=PullHint("127.0.0.1:1", blocks))  # not contacted
    prefix = kv.find_cached_prefix(req)
    if prefix is None:  # a pull started: the request waits aside until it ends
        if copier.answer is None:  # no answer: the engine gives up once the pull's time has passed
            assert kv.finish_loads() == [] and kv.next_load_deadline is not None
            time.sleep(max(0.0, kv.next_load_deadline - time.time()) + 0.01)
        assert kv.finish_loads() == ["r"]
        prefix = kv.find_cached_prefix(req)
    assert kv.allocate(req, len(PROMPT) - len(prefix) * BS, prefix)
    req.num_cached_tokens = len(prefix) * BS
    kv.record_hits(req, len(PROMPT))
    return len(prefix), [float(copier.device[b.block_id]) for b in prefix], req


def test_the_peers_run_is_pulled_and_counted_as_pulled():
    kv, copier = pulling()
    want = the_peer_computed(copier)
    cached, got, _ = hinted(kv, copier)
    assert cached == 4 and got == want
    assert kv.stats.hit_tokens_by_tier["pulled"] == 4 * BS and kv.pulls.stats.pulled_blocks == 4
    # the bandwidth from the holder's write time, not from when the engine got round to the answer
    assert kv.pulls.bandwidth == pytest.approx(400 / 0.04)


def test_a_partial_answer_brings_the_leading_blocks_and_the_rest_is_computed():
    kv, copier = pulling()
    want = the_peer_computed(copier)
    copier.answer = 2  # the peer evicted the rest meanwhile
    cached, got, _ = hinted(kv, copier)
    assert cached == 2 and got == want[:2]
    assert kv.host.num_used_blocks == 2  # the two unfilled host blocks went back at once


def test_no_answer_is_a_miss_and_its_host_blocks_wait_before_reuse():
    kv, copier = pulling(host_blocks=4)
    the_peer_computed(copier)
    copier.answer = None
    cached, _, _ = hinted(kv, copier)
    assert cached == 0 and kv.pulls.stats.failed == 1
    assert kv.host.reserve(b"x") is None  # all 4 held back: a late write may still land in them
    kv.host._quarantined = [(time.monotonic() - 1, b) for _, b in kv.host._quarantined]  # ... until their time
    assert kv.host.reserve(b"x") is not None


def test_local_hits_come_first_and_only_the_rest_is_asked_for():
    kv, copier = pulling()
    the_peer_computed(copier)
    run(kv, copier, PROMPT[:9])  # 2 blocks computed here
    cached, _, _ = hinted(kv, copier)
    assert cached == 4 and len(copier.asked[0]) == 2
    assert kv.stats.hit_tokens_by_tier["device"] == 2 * BS and kv.stats.hit_tokens_by_tier["pulled"] == 2 * BS


def test_computing_is_chosen_when_it_is_cheaper():
    kv, copier = pulling(prefill_rate=1e9)  # a prefill faster than any pull
    the_peer_computed(copier)
    cached, _, _ = hinted(kv, copier)
    assert cached == 0 and copier.asked == [] and kv.pulls.stats.skipped == 1


def test_the_host_block_index_forgets_an_overwritten_block():
    index = HostBlockIndex()
    index.put(0, b"a")
    index.put(1, b"b")
    assert index.run([b"a", b"b", b"c"]) == [0, 1]
    index.put(0, b"c")  # block 0 saved again with other content
    assert index.run([b"a"]) == [] and index.run([b"c"]) == [0]
    index.drop(1)  # about to be overwritten by a pull
    assert index.run([b"b"]) == []


def test_the_router_index_finds_the_peer_with_the_longest_run():
    index = KVIndex()
    index.set_sources("A", ["A#0"])
    index.set_sources("B", ["B#0"])
    index.apply("A#0", [BlockStored([b"1"], None, [], BS, None, None)])
    index.apply("B#0", [BlockStored([b"1", b"2", b"3"], None, [], BS, None, None)])
    assert index.longest_run([b"1", b"2", b"3", b"4"], exclude="A") == ("B#0", 3)
    assert index.longest_run([b"1", b"2"], exclude="B") == ("A#0", 1)
    assert index.longest_run([b"9"], exclude="A") is None


def test_pulled_blocks_go_on_to_the_disk_tier():
    from pdserve.engine.disk_tier import DiskTier

    kv, copier = pulling()
    kv.add_disk_tier(DiskTier(32, []))
    want = the_peer_computed(copier)
    hinted(kv, copier)
    copier.complete_writes(kv)
    assert len(kv.disk) == 4 and sorted(copier.disk.values()) == sorted(want[:4])
