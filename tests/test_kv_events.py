"""KV events: the prefix cache's changes as the engine publishes them (vLLM's wire format), and a router's
index kept from them equal to the cache itself, through evictions, the host tier, a reset, a subscriber
that joins late and one that misses batches. The cache is the KV cache manager driven as in
test_host_tier.py (no model); publisher and subscriber talk over real ZMQ sockets."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from pdserve.config.kv_events import KVEventsConfig, kv_events_config
from pdserve.config.lora import lora_hash_root
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.kv.block_hash import hash_block
from pdserve.kv_events.events import AllBlocksCleared, BlockStored
from pdserve.kv_events.index import DEVICE_BIT, DISK_BIT, HOST_BIT, KVIndex
from pdserve.kv_events.publisher import KVEventPublisher
from pdserve.kv_events.subscriber import KVEventSubscriber
from tests.servers import wait_for
from tests.test_disk_tier import manager as disk_manager
from tests.test_disk_tier import run as disk_run
from tests.test_host_tier import BS, manager, run


def cache_view(kv: KVCacheManager) -> dict[bytes, int]:
    """The engine's own view: hash -> tier bits."""
    view = {h: DEVICE_BIT for h in kv.pool.cached_hashes()}
    for h in kv.host.saved_hashes():
        view[h] = view.get(h, 0) | HOST_BIT
    return view


def workload(kv: KVCacheManager, copier, n: int = 12) -> None:  # noqa: ANN001
    """Prompts sharing prefixes, more than the 6 device blocks hold: evictions in both tiers."""
    for i in range(n):
        run(kv, copier, f"r{i}", [i % 3] * BS * 2 + [100 + i] * BS * 2 + [7])
        copier.complete_saves(kv)


def test_events_keep_an_index_equal_to_the_prefix_cache_through_evictions_and_a_reset() -> None:
    kv, copier = manager(device_blocks=6, host_blocks=5)
    recorder = kv.record_events()
    index = KVIndex()
    index.set_sources("http://e", ["e#0"])  # not contacted
    kinds = []
    for i in range(12):
        run(kv, copier, f"r{i}", [i % 3] * BS * 2 + [100 + i] * BS * 2 + [7])
        copier.complete_saves(kv)
        events = recorder.take()
        kinds += [(type(e).__name__, e.medium) for e in events if hasattr(e, "medium")]
        index.apply("e#0", events)
        assert index.blocks("e#0") == cache_view(kv), f"after request {i}"
    assert {("BlockStored", "GPU"), ("BlockStored", "CPU"), ("BlockRemoved", "GPU"), ("BlockRemoved", "CPU")} \
        <= set(kinds)
    prompt = [1] * BS * 2 + [101] * BS * 2 + [7]
    request = run(kv, copier, "again", prompt)  # the lookup's own answer, and the index's prediction of it
    assert index.cached_blocks("http://e", request.block_hashes[:4]) >= len(request.hits)  # not contacted
    kv.reset_prefix_cache()
    index.apply("e#0", recorder.take())
    assert index.blocks("e#0") == {} == cache_view(kv)


def test_blocks_of_a_lora_adapter_are_its_own_in_the_cache_and_in_the_events() -> None:
    kv, copier = manager(device_blocks=8, host_blocks=8)
    recorder = kv.record_events()
    tokens = [5] * BS * 2 + [7]
    run(kv, copier, "sql-1", tokens, lora_name="sql")
    stored = [e for e in recorder.take() if isinstance(e, BlockStored)]
    assert [e.lora_name for e in stored] == ["sql"] and len(stored[0].block_hashes) == 2
    assert run(kv, copier, "base", tokens).hits == []  # the same tokens under the base: nothing to reuse
    assert run(kv, copier, "chat", tokens, lora_name="chat").hits == []
    assert len(run(kv, copier, "sql-2", tokens, lora_name="sql").hits) == 2


def test_a_batch_is_vllm_wire_format() -> None:
    """Three frames (topic, 8-byte sequence number, msgpack payload); the payload an array-like tagged struct as
    vLLM's KVEventBatch: [ts, [[tag, fields...], ...], dp_rank]; one event for the request's run of blocks."""
    kv, copier = manager(device_blocks=6, host_blocks=5)
    ctx = zmq.Context()
    pub = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", topic="kv"),
                           kv.snapshot, ctx, data_parallel_rank=1)
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        recorder = kv.record_events()
        _until_connected(pub, sub)
        run(kv, copier, "r", list(range(BS * 2 + 1)))
        pub.publish(recorder.take())
        topic, seq, payload = sub.recv_multipart()
        raw = msgspec.msgpack.decode(payload)
        assert topic == b"kv" and len(seq) == 8 and int.from_bytes(seq, "big") == pub.seq
        ts, events, rank = raw
        assert isinstance(ts, float) and rank == 1
        (tag, hashes, parent, token_ids, block_size, lora_id, medium, *later), = events
        # vLLM's later fields: lora_name, extra_keys, then a layer group's group_idx, kind and window (one group: None)
        assert later == [None] * 5
        assert (tag, parent, token_ids, block_size, lora_id, medium) == ("BlockStored", None, list(range(BS * 2)), BS,
                                                                        None, "GPU")
        assert [len(h) for h in hashes] == [32, 32]  # SHA-256 chained block hashes, as the router computes them
    finally:
        sub.close()
        pub.close()
        ctx.destroy(linger=0)


def _until_connected(pub: KVEventPublisher, sub: zmq.Socket) -> None:
    """A PUB drops what it sends before a subscriber's connection is up (ZMQ's slow joiner)."""
    for _ in range(50):
        pub.publish([AllBlocksCleared()])
        if sub.poll(100):
            while sub.poll(50):
                sub.recv_multipart()
            return
    raise AssertionError("the subscriber never connected")


def test_a_late_subscriber_takes_a_snapshot_and_one_that_missed_batches_replays_them() -> None:
    kv, copier = manager(device_blocks=6, host_blocks=5)
    recorder = kv.record_events()
    ctx = zmq.Context()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*", buffer_steps=3)
    pub = KVEventPublisher(config, kv.snapshot, ctx)
    index = KVIndex()
    subscriber = KVEventSubscriber(index)

    def step(i: int) -> None:
        run(kv, copier, f"r{i}", [i % 3] * BS * 2 + [100 + i] * BS * 2 + [7])
        copier.complete_saves(kv)
        pub.publish(recorder.take())
        pub.serve_replays()

    def synced() -> bool:
        pub.serve_replays()
        return index.blocks("http://e#0") == cache_view(kv)  # not contacted

    try:
        for i in range(6):  # more batches than its buffer keeps: a subscriber joining now needs a snapshot
            step(i)
        subscriber.start()
        subscriber.watch("http://e", [(pub.endpoint, pub.replay_endpoint)])  # not contacted
        wait_for(synced, 10, "the late subscriber's index never matched the cache")
        assert subscriber.stats.snapshots == 1
        send = pub.pub.send_multipart
        pub.pub.send_multipart = lambda frames: None  # the next batch is lost on its way (past the HWM)
        step(6)
        pub.pub.send_multipart = send
        step(7)  # its number tells the gap: the lost batch comes from the replay buffer
        wait_for(synced, 10, "the subscriber did not replay the batch it missed")
        assert subscriber.stats.resyncs == 1 and subscriber.stats.snapshots == 1
        subscriber.watch("http://e", [])  # the instance left: nothing of it stays indexed (not contacted)
        forgotten = "http://e"  # not contacted
        wait_for(lambda: index.num_blocks == 0 and not index.tracks(forgotten), 5, "a forgotten instance stayed")
    finally:
        subscriber.close()
        pub.close()
        ctx.destroy(linger=0)


def test_a_publisher_restarted_at_the_same_address_is_indexed_anew() -> None:
    """A data-parallel rank restarted in place binds its ports again and numbers its batches from 0."""
    from tests.servers import free_port

    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{free_port()}",
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    ctx = zmq.Context()
    index = KVIndex()
    subscriber = KVEventSubscriber(index)
    subscriber.start()
    pub = None
    try:
        for life, steps in enumerate((8, 2)):
            kv, copier = manager(device_blocks=6, host_blocks=5)
            recorder = kv.record_events()
            pub = _bind_again(config, kv, ctx)
            if life == 0:
                subscriber.watch("http://e", [(pub.endpoint, pub.replay_endpoint)])  # not contacted
            for i in range(steps):
                run(kv, copier, f"r{life}-{i}", [life * 10 + i % 3] * BS * 2 + [7])
                copier.complete_saves(kv)
                pub.publish(recorder.take())

            def synced(kv: KVCacheManager = kv, pub: KVEventPublisher = pub) -> bool:
                pub.serve_replays()
                return index.blocks("http://e#0") == cache_view(kv)  # not contacted

            wait_for(synced, 10, f"the index of life {life} never matched its cache")
            pub.close()
            pub = None
        assert subscriber.stats.resyncs >= 1
    finally:
        subscriber.close()
        if pub is not None:
            pub.close()
        ctx.destroy(linger=0)


def _bind_again(config: KVEventsConfig, kv: KVCacheManager, ctx: zmq.Context) -> KVEventPublisher:
    """The ports of the publisher closed a moment ago (its sockets close in ZMQ's I/O thread)."""
    for _ in range(50):
        try:
            return KVEventPublisher(config, kv.snapshot, ctx)
        except RuntimeError:
            time.sleep(0.1)
    raise AssertionError(f"{config.endpoint} stayed taken")


def test_kv_events_config_takes_vllm_json_and_names_what_it_refuses() -> None:
    vllm_example = ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                    '"replay_endpoint": "tcp://*:5558", "buffer_steps": 100, "topic": "kv"}')  # not contacted
    config = kv_events_config(vllm_example)
    assert config.enabled and config.for_rank(2).endpoint == "tcp://*:5559"  # not contacted
    assert config.for_rank(2).replay_endpoint == "tcp://*:5560"  # not contacted
    assert not kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    with pytest.raises(ValueError, match="unknown_key"):
        kv_events_config('{"enable_kv_cache_events": true, "unknown_key": 1}')
    with pytest.raises(ValueError, match="publisher 'nats'"):
        kv_events_config('{"publisher": "nats"}')


def test_disk_tier_blocks_are_their_own_tier_in_the_index() -> None:
    kv, copier = disk_manager(device_blocks=6, host_blocks=4, disk_blocks=32)
    recorder = kv.record_events()
    index = KVIndex()
    index.set_sources("http://e", ["e#0"])  # not contacted
    first = list(range(1, 18))
    disk_run(kv, copier, first)
    for seed in range(3):  # push the first prompt out of the device cache and the host tier
        disk_run(kv, copier, [100 * (seed + 1) + t for t in range(17)])
    index.apply("e#0", recorder.take())
    view = cache_view(kv)
    for h in kv.disk.saved_hashes():
        view[h] = view.get(h, 0) | DISK_BIT
    assert index.blocks("e#0") == view
    hashes = [hash_block(lora_hash_root(None), first[:BS])]  # the first prompt's blocks, in order
    for i in range(1, 4):
        hashes.append(hash_block(hashes[-1], first[i * BS:(i + 1) * BS]))
    assert all(index.blocks("e#0")[h] == DISK_BIT for h in hashes)  # on disk only
    predicted = index.cached_blocks("http://e", hashes)  # not contacted
    cached, _ = disk_run(kv, copier, first)
    assert predicted == cached == 4  # the router foresees the disk hits the engine then takes
