"""Prefix pulls (`--enable-kv-pull`): a prompt's prefix blocks fetched from the peer instance that holds them.

A router whose KV events show another instance holding a longer prefix than the one it chose names that peer in
the request (`PullHint`). Past its own device, host and disk hits, the engine then asks its cache service to pull
the run from the peer's host tier into reserved host blocks (disagg/prefix_pulls.py, over the PD transports), and
copies them into the device cache as host hits are. It pulls only when that is cheaper than computing the tokens:
`PullCost` compares the pull's bytes at the bandwidth pulls have measured with the tokens at the prefill rate
the engine's steps have measured, both printed at start and in the metrics. A pull that fails or times out is a
miss (the engine computes); its host blocks are not reused until a late write could no longer land in them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from pdserve.engine.stats import PrefixPullStats


class PullHint(msgspec.Struct, frozen=True):
    """A router's word: the peer's block server (host:port) holds this many of the prompt's leading blocks."""

    addr: str
    num_blocks: int


SEED_BANDWIDTH = 1e9  # bytes/s assumed until a pull has been measured (a loopback tcp stream here does ~1-2 GB/s)
SEED_PREFILL_RATE = 2000.0  # tokens/s assumed until a prompt step has been measured
FIXED_COST_S = 0.002  # a pull's round trip besides its bytes
TIMEOUT_S = 2.0  # a pull's answer later than its size's time at a quarter of the bandwidth plus this is a miss
QUARANTINE_S = 30.0  # after a pull's deadline, how long its host blocks stay unused (a late write may still land)
ALPHA = 0.3  # weight of a new bandwidth measurement


class PullCost:
    def __init__(self, block_bytes: int, block_size: int, prefill_rate: Callable[[], float]) -> None:
        self.block_bytes, self.block_size = block_bytes, block_size
        self._prefill_rate = prefill_rate
        self.bandwidth = SEED_BANDWIDTH
        self._measured = False
        self.stats = PrefixPullStats()

    @property
    def prefill_rate(self) -> float:
        return self._prefill_rate() or SEED_PREFILL_RATE

    def pull_seconds(self, num_blocks: int) -> float:
        return FIXED_COST_S + num_blocks * self.block_bytes / self.bandwidth

    def compute_seconds(self, num_blocks: int) -> float:
        return num_blocks * self.block_size / self.prefill_rate

    def pays(self, num_blocks: int) -> bool:
        return num_blocks > 0 and self.pull_seconds(num_blocks) < self.compute_seconds(num_blocks)

    def deadline(self, num_blocks: int) -> float:
        """Unix time by which the holder must have started writing."""
        return time.time() + TIMEOUT_S + 4 * num_blocks * self.block_bytes / self.bandwidth

    def measured(self, nbytes: int, seconds: float, round_trip: bool = True) -> None:
        """A pull moved `nbytes` in `seconds`: the asker's wall time (`round_trip`), or the holder's writing alone."""
        self.stats.nbytes += nbytes
        self.stats.seconds += seconds
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / (max(seconds - FIXED_COST_S, seconds / 2) if round_trip else seconds)
        self.bandwidth = rate if not self._measured else ALPHA * rate + (1 - ALPHA) * self.bandwidth
        self._measured = True

    def describe(self) -> str:
        measured = "measured" if self._measured else "assumed until a pull"
        prefill = "measured" if self._prefill_rate() else "assumed until a prompt step"
        return (f"pull bandwidth {self.bandwidth / 1e9:.2f} GB/s ({measured}), prefill {self.prefill_rate:.0f} "
                f"tokens/s ({prefill}): a block costs {self.block_bytes / self.bandwidth * 1e3:.3f} ms to pull "
                f"(plus {FIXED_COST_S * 1e3:.0f} ms a pull), {self.compute_seconds(1) * 1e3:.2f} ms to compute")
