"""A router's exact index of what every engine caches, kept from their KV events: block hash -> the
engines (sources) holding it and in which tier.

A source is one engine's event stream: an instance's url, or one of its data-parallel ranks (a mixed
server registers the union of its ranks, and a prompt is scored on its best rank). The subscriber thread
applies batches; the router's policies read; a lock keeps the two apart (both are short).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from pdserve.kv_events.events import (
    DEVICE,
    DISK,
    FULL_ATTENTION,
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

DEVICE_BIT, HOST_BIT, DISK_BIT = 1, 2, 4
_BITS = {DEVICE: DEVICE_BIT, HOST: HOST_BIT, DISK: DISK_BIT, None: DEVICE_BIT}
_BELOW_DEVICE = HOST_BIT | DISK_BIT  # after its device hits, the engine's lookup takes blocks from either


class KVIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[bytes, dict[str, int]] = {}  # block hash -> {source: tier bits}
        self._held: dict[str, set[bytes]] = {}  # source -> its block hashes
        self._sources: dict[str, list[str]] = {}  # url -> its sources
        self._full_groups: dict[str, set[int]] = {}  # source -> its full-attention layer groups (KV events' group_idx)

    # ---- written by the subscriber -------------------------------------------------------------

    def set_sources(self, url: str, sources: list[str]) -> None:
        """`url` publishes on these sources from now on (none: forget it); what was indexed for it is dropped."""
        with self._lock:
            for source in self._sources.pop(url, []):
                self._clear(source)
                del self._held[source]
                self._full_groups.pop(source, None)
            if sources:
                self._sources[url] = list(sources)
                for source in sources:
                    self._held[source] = set()

    def apply(self, source: str, events: Iterable[KVEvent]) -> None:
        with self._lock:
            if source not in self._held:
                return  # its url was forgotten while the batch was on its way
            for event in events:
                if not isinstance(event, AllBlocksCleared) and not self._indexed(source, event):
                    continue
                if isinstance(event, BlockStored):
                    self._store(source, event.block_hashes, _BITS.get(event.medium, DEVICE_BIT))
                elif isinstance(event, BlockRemoved):
                    self._remove(source, event.block_hashes, _BITS.get(event.medium, DEVICE_BIT))
                elif isinstance(event, AllBlocksCleared):
                    self._clear(source)

    def _indexed(self, source: str, event: BlockStored | BlockRemoved) -> bool:
        """Whether the event's layer group is indexed: with layer groups (group_idx), the first full-attention group's
        blocks say what a prefix hit finds (a sliding-window group drops blocks the hit does not need; another full
        group holds the same hashes, and its events would undo the first one's). A store names its group's kind;
        until one does, group 0 is taken for full attention."""
        group = event.group_idx
        if group is None:
            return True
        full = self._full_groups.setdefault(source, {0})
        if isinstance(event, BlockStored) and event.kv_cache_spec_kind is not None:
            (full.add if event.kv_cache_spec_kind == FULL_ATTENTION else full.discard)(group)
        return bool(full) and group == min(full)

    def clear(self, source: str) -> None:
        with self._lock:
            if source in self._held:
                self._clear(source)

    def _store(self, source: str, hashes: list, bit: int) -> None:
        held = self._held[source]
        for h in hashes:
            holders = self._holders.setdefault(h, {})
            holders[source] = holders.get(source, 0) | bit
            held.add(h)

    def _remove(self, source: str, hashes: list, bit: int) -> None:
        held = self._held[source]
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None or source not in holders:
                continue
            if bits := holders[source] & ~bit:
                holders[source] = bits
                continue
            del holders[source]
            held.discard(h)
            if not holders:
                del self._holders[h]

    def _clear(self, source: str) -> None:
        """Drop every block of `source` (it stays a source)."""
        for h in self._held[source]:
            holders = self._holders[h]
            del holders[source]
            if not holders:
                del self._holders[h]
        self._held[source] = set()

    # ---- read by the policies ------------------------------------------------------------------

    def tracks(self, url: str) -> bool:
        return url in self._sources

    def cached_blocks(self, url: str, hashes: list[bytes]) -> int:
        """How many of the prompt's leading blocks `url` would take from its cache (its best source): a run
        in the device cache, continued in the host and disk tiers, as the engine's lookup goes."""
        with self._lock:
            return max((self._run(source, hashes) for source in self._sources.get(url, ())), default=0)

    def longest_run(self, hashes: list[bytes], exclude: str) -> tuple[str, int] | None:
        """The source (other than `exclude`'s) whose cache holds the longest run of the prompt's leading blocks,
        and how many: where a prefix could be pulled from."""
        with self._lock:
            if not hashes:
                return None
            mine = set(self._sources.get(exclude, ()))
            runs = [(self._run(s, hashes), s) for s in self._holders.get(hashes[0], {}) if s not in mine]
            n, source = max(runs, default=(0, ""))
            return (source, n) if n else None

    def _run(self, source: str, hashes: list[bytes]) -> int:
        tier = DEVICE_BIT
        for n, h in enumerate(hashes):
            bits = self._holders.get(h, {}).get(source, 0)
            if not bits & tier:
                if tier == _BELOW_DEVICE or not bits & _BELOW_DEVICE:
                    return n
                tier = _BELOW_DEVICE  # the device run ended; the host and disk tiers go on from here
        return len(hashes)

    def blocks(self, source: str) -> dict[bytes, int]:
        """The source's blocks and their tier bits (what the tests compare with the engine's cache)."""
        with self._lock:
            return {h: self._holders[h][source] for h in self._held.get(source, ())}

    @property
    def num_blocks(self) -> int:
        return len(self._holders)
