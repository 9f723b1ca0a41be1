"""What each instance caches, as far as a picker knows: exactly, from the KV events it publishes
(kv_events/index.py), or else approximately, from the prompt blocks the picker sent it (an LRU of block
hashes per instance: it sees no eviction and no other router's traffic)."""

from __future__ import annotations

from collections import OrderedDict

from pdserve.kv_events.index import KVIndex


class CacheView:
    def __init__(self, kv_index: KVIndex | None = None, max_blocks_per_instance: int = 100_000) -> None:
        self.kv_index = kv_index
        self.approximate = PrefixIndex(max_blocks_per_instance)

    def cached_blocks(self, url: str, hashes: list[bytes]) -> int:
        """How many of the prompt's leading blocks `url` holds."""
        if self.exact(url):
            return self.kv_index.cached_blocks(url, hashes)
        return self.approximate.matched(url, hashes)

    def sent(self, url: str, hashes: list[bytes]) -> None:
        """The prompt goes to `url` (remembered where no events tell what it holds)."""
        if not self.exact(url):
            self.approximate.remember(url, hashes)

    def exact(self, url: str) -> bool:
        return self.kv_index is not None and self.kv_index.tracks(url)


class PrefixIndex:
    def __init__(self, max_blocks_per_instance: int = 100_000) -> None:
        self.max_blocks = max_blocks_per_instance
        self._index: dict[str, OrderedDict[bytes, None]] = {}

    def matched(self, url: str, hashes: list[bytes]) -> int:
        """How many of the prompt's leading blocks `url` was sent before."""
        index = self._index.get(url, {})
        n = 0
        for h in hashes:
            if h not in index:
                break
            n += 1
        return n

    def remember(self, url: str, hashes: list[bytes]) -> None:
        index = self._index.setdefault(url, OrderedDict())
        for h in hashes:
            index[h] = None
            index.move_to_end(h)
        while len(index) > self.max_blocks:
            index.popitem(last=False)
