"""Prefix blocks brought into the host tier off the step: a disk-tier read or a pull from a peer runs in the
cache service while its request waits in its own state (the scheduler's `loading`), as a decode instance's
requests wait for their prefill's KV; the other requests keep stepping. The engine polls for the results
(`LoadResult`, reported on the cache service's socket); a load that fails or passes its deadline is a miss,
and the request computes those tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.request import Request


@dataclass
class LoadResult:
    """What the cache service did with one load: per block asked, whether it is now in its host block."""

    load_id: str
    ok: list[bool]
    nbytes: int = 0
    seconds: float = 0.0  # a pull: how long the holder took to write the blocks (0: not said)


@dataclass
class PrefixLoad:
    load_id: str
    request: Request
    source: str  # the tier the blocks come from (kv_cache_manager.DISK_TIER or PULLED)
    keys: list[bytes]  # block hashes
    host_blocks: list[int]
    started: float  # time.perf_counter()
    answer_by: float = float("inf")  # unix time: a pull with no answer by then failed
    cancelled: bool = False  # the host tier was cleared meanwhile: nothing it brings is kept
