"""The two halves of a device cache's copies (issue 28) without processes: the engine's queue
(engine/worker_copies.py) reports a copy only once the worker has run it, and the worker's KVCopier
moves exactly the blocks (and layers) asked, in runs, with events that a slowed copy really makes
wait. The end-to-end checks are in test_pd_device_cache.py."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.worker_copies import WorkerCopies
from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout, block_runs
from pdserve.worker.kv_copier import DELAY_ENV, KVCopier
from pdserve.worker.protocol import DEVICE

LAYOUT = KVLayout(num_blocks=8, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def test_block_runs_merge_pairs_adjacent_on_both_sides() -> None:
    assert block_runs([0, 1, 2, 5, 6], [3, 4, 5, 7, 0]) == [(0, 3, 3), (5, 7, 1), (6, 0, 1)]
    assert block_runs([], []) == []


def test_queued_copies_are_reported_only_after_the_worker_ran_them() -> None:
    copies = WorkerCopies(block_bytes=100)
    copies.save_blocks(7, [1, 2], [0, 1])
    copies.swap_in("t1", [4, 5, 6], [2, 3, 4])
    copies.load_blocks([3], [5])
    copies.stage_in([6, 7])
    copies.save_blocks(8, [], [])  # nothing to copy: done at once
    assert copies.blocks_saved() == [(8, [])]
    assert copies.pending
    step = copies.take()
    assert [(c.src, c.dst, c.src_blocks, c.dst_blocks) for c in step] == [
        ("device", "host", [1, 2], [0, 1]), ("buffer", "device", [4, 5, 6], [2, 3, 4]),
        ("host", "device", [3], [5]), ("staging", "device", [6, 7], [6, 7])]  # queue order: the worker's order
    assert not copies.pending and copies.take() == []
    assert copies.blocks_saved() == [] and copies.swaps_done() == []  # sent, not yet run
    copies.done([step[1].copy_id])
    assert copies.blocks_saved() == []
    (swap,) = copies.swaps_done()
    assert swap[:2] == ("t1", 300)
    copies.done([c.copy_id for c in step])  # ids reported twice are ignored
    assert copies.blocks_saved() == [(7, [0, 1])]
    assert copies.swaps_done() == []


@pytest.fixture
def caches() -> tuple[KVCache, KVCache]:
    device = KVCache.allocate(LAYOUT, "cpu")
    device.tensor.copy_(torch.arange(device.tensor.numel(), dtype=torch.float32).view(LAYOUT.shape))
    host = KVCache.create_shared(LAYOUT)
    yield device, host
    host.close()


def test_copier_moves_the_blocks_and_layers_asked(caches: tuple[KVCache, KVCache]) -> None:
    device, host = caches
    copier = KVCopier(lambda: device, {"staging": host}, torch.device("cpu"))
    copier.copy(DEVICE, "staging", [0, 1, 5], [2, 3, 7], layer=1).synchronize()
    for s, d in ((0, 2), (1, 3), (5, 7)):
        assert torch.equal(host.tensor[d, 1], device.tensor[s, 1])
        assert not host.tensor[d, 0].any() and not host.tensor[d, 2].any()  # other layers untouched
    assert not host.tensor[[0, 1, 4, 5, 6]].any()
    copier.copy("staging", DEVICE, [2, 3], [6, 4]).synchronize()  # whole blocks back
    assert torch.equal(device.tensor[6], host.tensor[2]) and torch.equal(device.tensor[4], host.tensor[3])
    with pytest.raises(ValueError, match="no 'buffer' host segment"):
        copier.copy(DEVICE, "buffer", [0], [0])
    copier.close()


def test_a_slowed_copy_completes_only_when_waited_for(caches: tuple[KVCache, KVCache],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    device, host = caches
    monkeypatch.setenv(DELAY_ENV, "0.2")
    copier = KVCopier(lambda: device, {"staging": host}, torch.device("cpu"))
    event = copier.copy(DEVICE, "staging", [0, 1], [0, 1])
    assert not event.query() and not host.tensor[0].any()  # still in flight: nothing there yet
    copier.device_waits(event)
    assert event.query() and torch.equal(host.tensor[:2], device.tensor[:2])
    later = copier.copy(DEVICE, "staging", [2], [2], layer=0)
    copier.synchronize()  # every copy launched so far
    assert later.query() and torch.equal(host.tensor[2, 0], device.tensor[2, 0])
    copier.close()
