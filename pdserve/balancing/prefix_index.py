"""The router's memory of which prompt blocks it sent to each instance: an LRU of block hashes per
instance, an approximation of each engine's prefix cache (no scrape on the request path)."""

from __future__ import annotations

from collections import OrderedDict


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
