"""What a router's KV index costs: a router process subscribed to N simulated engines that publish, together,
R KV events per second (half BlockStored of a block chain, half BlockRemoved of earlier ones), measured as the
router process's CPU time over the run.

    .venv/bin/python bench/kv_index_cpu.py [--publishers 100] [--events-per-second 1000] [--seconds 10]

The publishers run in another process (real ZMQ PUB + replay sockets, pdserve's publisher), so the CPU
counted is the subscriber thread's alone: receiving, decoding, applying to the index. Goal (issue 38):
under 5% of one core at 1,000 events/s from 100 instances.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import time

import zmq

from pdserve.config.kv_events import KVEventsConfig
from pdserve.kv_events.events import BlockRemoved, BlockStored
from pdserve.kv_events.index import KVIndex
from pdserve.kv_events.publisher import KVEventPublisher
from pdserve.kv_events.subscriber import KVEventSubscriber


def publish(n: int, rate: float, seconds: float, ready, endpoints) -> None:  # noqa: ANN001
    ctx = zmq.Context()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*")
    pubs = [KVEventPublisher(config, list, ctx) for _ in range(n)]
    endpoints.extend([(p.endpoint, p.replay_endpoint) for p in pubs])
    ready.wait()
    time.sleep(1.0)  # the subscriptions connect
    for p in pubs:
        p.serve_replays()
    chains = [[] for _ in range(n)]
    interval, sent, start = 1.0 / rate, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        i = sent % n
        pub, chain = pubs[i], chains[i]
        if sent // n % 2 == 0 or not chain:
            new = [hashlib.sha256(f"{i}-{sent}-{k}".encode()).digest() for k in range(4)]
            pub.publish([BlockStored(new, chain[-1] if chain else None, list(range(64)), 16, None, "GPU")])
            chain.extend(new)
        else:
            pub.publish([BlockRemoved(chain[:4], "GPU")])
            del chain[:4]
        pub.serve_replays()
        sent += 1
        time.sleep(max(0.0, start + sent * interval - time.perf_counter()))
    time.sleep(0.5)
    for p in pubs:
        p.close()
    ctx.term()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--publishers", type=int, default=100)
    p.add_argument("--events-per-second", type=float, default=1000)
    p.add_argument("--seconds", type=float, default=10)
    args = p.parse_args()
    manager = multiprocessing.Manager()
    ready, endpoints = manager.Event(), manager.list()
    child = multiprocessing.Process(target=publish, args=(args.publishers, args.events_per_second, args.seconds,
                                                          ready, endpoints))
    child.start()
    while len(endpoints) < args.publishers:
        time.sleep(0.05)
    index = KVIndex()
    subscriber = KVEventSubscriber(index)
    subscriber.start()
    for i, (endpoint, replay) in enumerate(list(endpoints)):
        subscriber.watch(f"http://engine-{i}", [(endpoint, replay)])  # not contacted
    ready.set()
    time.sleep(1.0)
    cpu0, wall0, events0 = time.process_time(), time.perf_counter(), subscriber.stats.events
    child.join()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    events = subscriber.stats.events - events0
    subscriber.close()
    print(f"{args.publishers} publishers, {events} events in {wall:.1f} s ({events / wall:.0f}/s): router CPU "
          f"{cpu:.2f} s = {100 * cpu / wall:.1f}% of one core, {1e6 * cpu / max(events, 1):.1f} us per event; "
          f"resyncs {subscriber.stats.resyncs}, snapshots {subscriber.stats.snapshots}, index {index.num_blocks} "
          "blocks (goal: < 5% of a core at 1,000 events/s)")


if __name__ == "__main__":
    main()
