"""Which peer an instance should pull a prompt's prefix from (`--enable-kv-pull` on the instances).

The router's exact index (KV events) knows every engine's cached blocks. When the instance it chose to compute a
prompt holds fewer of its leading blocks than another engine does, the request tells the chosen one where that
engine's block server is (the body's `kv_pull`); the engine pulls what it lacks if that is cheaper than computing
it (engine/prefix_pull.py). Only between instances that both pull, on one model and KV layout.
"""

from __future__ import annotations

from pdserve.balancing.policies import RoutedRequest
from pdserve.kv_events.index import KVIndex
from pdserve.router.registry import Instance, Registry

MIN_GAIN_BLOCKS = 2  # a peer must hold at least this many blocks more than the chosen instance


def pull_hint(index: KVIndex | None, registry: Registry, target: Instance, request: RoutedRequest) -> dict | None:
    """The `kv_pull` field for a request `target` computes, or None."""
    block_size = target.block_size
    if index is None or block_size is None or not any(s.pull for s in target.info.kv_events):
        return None
    hashes = request.lookup_hashes(block_size)
    best = index.longest_run(hashes, exclude=target.url)
    if best is None:
        return None
    source, n = best
    if n < index.cached_blocks(target.url, hashes) + MIN_GAIN_BLOCKS:
        return None
    addr = _pull_address(registry, target, source)
    return None if addr is None else {"addr": addr, "num_blocks": n}


def _pull_address(registry: Registry, target: Instance, source: str) -> str | None:
    """The block server of `source` ("url#rank", kv_events/subscriber.py), if it is a healthy peer of `target`."""
    url, _, rank = source.rpartition("#")
    holder = next((i for i in registry.healthy() if i.url == url), None)
    if holder is None or holder.info.compatibility_key != target.info.compatibility_key \
            or holder.block_size != target.block_size:
        return None
    sources = holder.info.kv_events
    return sources[int(rank)].pull if rank.isdigit() and int(rank) < len(sources) else None
