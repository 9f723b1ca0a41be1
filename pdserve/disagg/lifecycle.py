"""A PD request's life on each side: the phases, the transitions allowed between them, the lease rules.

Prefill instance (P), one `PrefillPhase` per transfer (prefill_connector.py):

    AWAITING_CACHE_INFO --cache info ok--> SCHEDULED --first token---> PREFILLED --KV written---+
                                               |                                              v
                                               +----KV written----> KV_WRITTEN --first token--> DONE_SENT
                                                                                                  |
                                          RELEASED <--D's ack, or no ack by the lease's end-------+
    Any phase before DONE_SENT --a failure--> FAILED; any phase before RELEASED --abort--> ABORTED.

  P holds no blocks while AWAITING_CACHE_INFO (D may be queueing for blocks), computes the prompt
  while SCHEDULED, sends *prefill done* only when both the first token and the messager's "every
  byte written" are in (DONE_SENT), and frees its blocks on D's ack, or when D's lease has surely
  ended without one.

Decode instance (D), one `DecodePhase` per transfer (decode_connector.py):

    QUEUED --blocks free--> PREALLOCATED --prefill done--> DECODING (the scheduler's from here on)
      |                         |    \
      |                         |     +--prefill done, into the buffer--> BUFFERED --cache blocks free-->
      |                         |                                          SWAPPING_IN --copied--> DECODING
      +--queue timeout----------+--lease over / P's error--> GAVE_UP   (blocks quarantined)
      +--frontend abort---------+-------------------------> ABORTED   (from any phase before DECODING)

  D reserves blocks for the whole prompt and sends P *cache info* (PREALLOCATED): its own cache
  blocks, or with --splitwise-cache-buffer-size blocks of the host buffer. P's KV lands there with no
  message until *prefill done*, so "receiving" is not a phase D can observe. From the buffer, D acks
  P at once (P frees its blocks) and takes cache blocks only when it can: BUFFERED until they are
  free, SWAPPING_IN while the cache service copies buffer -> cache.

Lease rules (times are D's --pd-transfer-timeout, the lease):
- D gives its blocks up when *prefill done* has not come within one lease of the last sign of P
  (cache info sent, or P's LeaseRenew, which P sends every third of a lease while it holds the request,
  from inside a long step too: the engine calls the connector's during_step while the worker runs).
- P stops writing LEASE_MARGIN before D's lease ends (by D's clock and by receipt, whichever is earlier).
- Blocks D gives up stay quarantined until P can no longer be writing into them (lease end plus
  QUARANTINE_GRACE), so a late write never lands in another request's blocks.
- D waits at most QUEUE_TIMEOUT_LEASES leases for free blocks; P waits at most AWAIT_INFO_LEASES
  for cache info (D gives up first and says so).
"""

from __future__ import annotations

import enum

LEASE_MARGIN = 1.0  # P stops writing this long before D's lease ends (covers message transit)
QUARANTINE_GRACE = 1.0  # D reuses given-up blocks this long after its lease ended (covers a write in flight)
QUEUE_TIMEOUT_LEASES = 5  # D waits at most this many --pd-transfer-timeout for free blocks
AWAIT_INFO_LEASES = 10  # P waits at most this many for cache info


class PrefillPhase(enum.Enum):
    AWAITING_CACHE_INFO = "awaiting_cache_info"
    SCHEDULED = "scheduled"  # in P's scheduler: computing the prompt, the messager writing layer by layer
    PREFILLED = "prefilled"  # first token out; KV still being written
    KV_WRITTEN = "kv_written"  # every byte written; first token not yet seen
    DONE_SENT = "done_sent"  # D told; P's blocks held until D's ack
    RELEASED = "released"
    FAILED = "failed"
    ABORTED = "aborted"


class DecodePhase(enum.Enum):
    QUEUED = "queued"  # waiting for free blocks; P has heard nothing
    PREALLOCATED = "preallocated"  # blocks held (cache or buffer), cache info sent, P's KV may be arriving
    BUFFERED = "buffered"  # the whole KV is in the buffer, P released; waiting for cache blocks
    SWAPPING_IN = "swapping_in"  # cache blocks held, the cache service copying buffer -> cache
    DECODING = "decoding"
    GAVE_UP = "gave_up"
    ABORTED = "aborted"


_P = PrefillPhase
_D = DecodePhase

PREFILL_TRANSITIONS: dict[PrefillPhase, frozenset[PrefillPhase]] = {
    _P.AWAITING_CACHE_INFO: frozenset({_P.SCHEDULED, _P.FAILED, _P.ABORTED}),
    _P.SCHEDULED: frozenset({_P.PREFILLED, _P.KV_WRITTEN, _P.FAILED, _P.ABORTED}),
    _P.PREFILLED: frozenset({_P.DONE_SENT, _P.FAILED, _P.ABORTED}),
    _P.KV_WRITTEN: frozenset({_P.DONE_SENT, _P.FAILED, _P.ABORTED}),
    _P.DONE_SENT: frozenset({_P.RELEASED, _P.ABORTED}),
    _P.RELEASED: frozenset(),
    _P.FAILED: frozenset(),
    _P.ABORTED: frozenset(),
}

DECODE_TRANSITIONS: dict[DecodePhase, frozenset[DecodePhase]] = {
    _D.QUEUED: frozenset({_D.PREALLOCATED, _D.GAVE_UP, _D.ABORTED}),
    _D.PREALLOCATED: frozenset({_D.DECODING, _D.BUFFERED, _D.GAVE_UP, _D.ABORTED}),
    _D.BUFFERED: frozenset({_D.SWAPPING_IN, _D.ABORTED}),
    _D.SWAPPING_IN: frozenset({_D.DECODING, _D.ABORTED}),
    _D.DECODING: frozenset(),
    _D.GAVE_UP: frozenset(),
    _D.ABORTED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(table: dict, src: enum.Enum, dst: enum.Enum, transfer_id: str) -> None:
    if dst not in table[src]:
        raise IllegalTransition(f"PD transfer {transfer_id}: {src.value} -> {dst.value} is not a transition "
                                "of its lifecycle (pdserve/disagg/lifecycle.py)")
