"""Messages of the PD machinery, all msgspec (no pickle on any socket).

- worker -> cache messager: which blocks of this step go where, then one signal per finished layer;
- cache messager -> engine: a request's KV is (or failed to get) written;
- engine <-> cache service: create or attach the cache at startup; copies between the cache and the
  host tier (--swap-space) or the splitwise buffer;
- control plane between a decode engine (DEALER) and a prefill engine (ROUTER on --pd-comm-port).
"""

from __future__ import annotations

import msgspec

from pdserve.kv.layout import KVLayout
from pdserve.transport import Endpoint
from pdserve.worker.protocol import TokenLogprobs

# ---- cache service <-> engine ----------------------------------------------------------------


class CreateCache(msgspec.Struct, tag=True):
    """Create the cache's segment (a cache in device memory: the staging area that mirrors it) and the
    host segments asked for."""

    layout: KVLayout
    buffer_blocks: int = 0  # decode role: a host buffer of this many blocks (same layout) receives P's KV
    host_blocks: int = 0  # --swap-space: the host prefix tier, this many blocks of the same layout
    cache_segment: bool = True  # False: a mixed instance's device cache needs only the host tier
    disk_folder: str | None = None  # --kv-disk-path: this producer's folder of block files (kv/disk_store.py)
    fingerprint: str | None = None  # what produced the KV bytes (kv/disk_store.fingerprint): pulls match it


class AttachCache(msgspec.Struct, tag=True):
    layout: KVLayout
    segment: str
    host_blocks: int = 0  # at startup only; an AttachCache after weights were reloaded keeps the tier
    disk_folder: str | None = None  # at startup only, as in CreateCache
    fingerprint: str | None = None  # at startup only, as in CreateCache


class DetachCache(msgspec.Struct, tag=True):
    """Mixed role: the worker is freeing the cache (POST /clear_load_weight); let go of it too."""


class ExtendDeadline(msgspec.Struct, tag=True):
    """P renewed D's lease: the messager may write this transfer until `deadline` (it may be behind the
    worker, so the deadline a plan was made with can be stale by the time it writes)."""

    transfer_id: str
    deadline: float


class SwapIn(msgspec.Struct, tag=True):
    """Decode role: copy these buffer blocks into these cache blocks (FastDeploy's SPLITWISE_CPU2GPU)."""

    transfer_id: str
    buffer_blocks: list[int]
    cache_blocks: list[int]


class SaveBlocks(msgspec.Struct, tag=True):
    """Host tier: copy these cache blocks into these host blocks and report BlocksSaved; then write those with a
    disk key to the disk tier (b"": not), reported by DiskWritten."""

    save_id: int
    cache_blocks: list[int]
    host_blocks: list[int]
    disk_keys: list[bytes] = []
    hashes: list[bytes] = []  # --enable-kv-pull: each block's hash, so that the service can serve it to peers


class LoadBlocks(msgspec.Struct, tag=True):
    """Host tier: copy these host blocks into these cache blocks, then report BlocksLoaded."""

    host_blocks: list[int]
    cache_blocks: list[int]


class LoadFromDisk(msgspec.Struct, tag=True):
    """Disk tier: read these blocks' files into these host blocks, then report DiskLoaded."""

    keys: list[bytes]
    host_blocks: list[int]
    load_id: str = ""


class WriteToDisk(msgspec.Struct, tag=True):
    """Disk tier: write these host blocks' bytes under these keys (a cache with the worker's copies, or the clean
    stop's dump of blocks the disk lacks); reported by DiskWritten."""

    keys: list[bytes]
    host_blocks: list[int]


class HostBlocksFilled(msgspec.Struct, tag=True):
    """The worker copied device-cache blocks into these host blocks (a cache in device memory): what SaveBlocks
    does after its own copy, for them (index their hashes for pulls, write those with a disk key)."""

    host_blocks: list[int]
    disk_keys: list[bytes] = []
    hashes: list[bytes] = []


class RemoveFromDisk(msgspec.Struct, tag=True):
    """Disk tier: these blocks' files are to go (dropped for room, or the prefix cache was reset)."""

    keys: list[bytes]


class ForgetHostBlocks(msgspec.Struct, tag=True):
    """The host tier was cleared (a reset): serve none of its blocks to peers any more."""


class PullFrom(msgspec.Struct, tag=True):
    """--enable-kv-pull: ask the peer's cache service at `addr` (host:port) for this run of blocks, to be written
    into these host blocks (which stop being served meanwhile) by `deadline` (unix time); then report PullDone."""

    pull_id: str
    addr: str
    hashes: list[bytes]
    host_blocks: list[int]
    deadline: float


class ServiceShutdown(msgspec.Struct, tag=True):
    pass


ServiceInput = (CreateCache | AttachCache | DetachCache | ExtendDeadline | SwapIn | SaveBlocks | LoadBlocks
                | LoadFromDisk | WriteToDisk | HostBlocksFilled | RemoveFromDisk | ForgetHostBlocks | PullFrom
                | ServiceShutdown)


class CacheServiceReady(msgspec.Struct, tag=True):
    segment: str | None
    created: bool
    endpoints: list[Endpoint]  # what a prefill instance can write to (decode role: the buffer, if any)
    messager_address: str | None  # where the worker sends StepTransfers / LayerDone (prefill side)
    buffer_segment: str | None = None  # decode role with a splitwise cache buffer
    host_segment: str | None = None  # with --swap-space
    pull_port: int | None = None  # --enable-kv-pull: where peers ask for this instance's host-tier blocks
    host_endpoints: list[Endpoint] = []  # --enable-kv-pull: where peers write blocks pulled into the host tier


class TransferDone(msgspec.Struct, tag=True):
    transfer_id: str
    ok: bool
    error: str | None = None
    nbytes: int = 0
    first_write: float | None = None  # unix time the first layer was written
    last_write: float | None = None


class SwapDone(msgspec.Struct, tag=True):
    transfer_id: str
    nbytes: int
    seconds: float


class BlocksSaved(msgspec.Struct, tag=True):
    save_id: int
    host_blocks: list[int]
    seconds: float


class DiskWritten(msgspec.Struct, tag=True):
    """Disk writes that finished since the last report (off the service's loop)."""

    written: list[bytes]  # keys whose files are whole now
    failed: list[bytes] = []  # keys not written (a full disk, or too many writes queued): memory only


class PullDone(msgspec.Struct, tag=True):
    pull_id: str
    num_blocks: int  # the leading blocks of the run now in the host blocks asked for
    nbytes: int = 0
    error: str | None = None
    seconds: float = 0.0  # the holder's time writing them


class BlocksLoaded(msgspec.Struct, tag=True):
    seconds: float


class DiskLoaded(msgspec.Struct, tag=True):
    ok: list[bool]  # per key: read whole and intact (False: gone or damaged, a miss)
    seconds: float
    load_id: str = ""


class ServiceError(msgspec.Struct, tag=True):
    error: str


class ReceiverStats(msgspec.Struct, tag=True):
    """Decode side: sent when the count changes, so the engine can export it."""

    refused_connections: int  # KV connections that failed the cluster-secret challenge, since start


ServiceMessage = (CacheServiceReady | TransferDone | SwapDone | BlocksSaved | BlocksLoaded | DiskLoaded
                  | DiskWritten | PullDone | ServiceError | ReceiverStats)


# ---- control plane: decode <-> prefill -------------------------------------------------------


class CacheInfo(msgspec.Struct, tag=True):
    """D -> P: D holds blocks for the request; write its prompt KV there."""

    transfer_id: str
    prompt_len: int
    prompt_digest: str  # P checks it tokenized the same prompt
    dst_blocks: list[int]  # D's own block ids, one per block of the prompt
    layout: KVLayout
    endpoints: list[Endpoint]
    lease: float  # seconds from now until D gives the blocks up
    lease_until: float  # the same moment on D's clock (unix time)
    skip_blocks: int = 0  # D's prefix cache holds the prompt's first blocks: P sends only the rest
    lora_name: str | None = None  # the LoRA adapter D decodes with: P's KV must be computed under the same
    # Layer groups 1.. (config/layer_groups.py): D's block per block of the prompt, NOT_WANTED where D needs none
    # (out of the window it decodes from, or in its own prefix cache). Empty with one block table.
    group_dst_blocks: list[list[int]] = []


NOT_WANTED = -1  # a CacheInfo.group_dst_blocks entry: P sends nothing for that block


class PrefillDone(msgspec.Struct, tag=True):
    """P -> D: every byte is written; decode from `first_token`."""

    transfer_id: str
    first_token: int
    logprobs: TokenLogprobs | None
    nbytes: int
    times: dict[str, float]  # prefill_start, first_layer_written, last_layer_written, first_token
    protocol: str | None = None  # the transport that wrote the KV


class LeaseRenew(msgspec.Struct, tag=True):
    """P -> D, every third of the lease while P holds the request: still on it (it may be queued behind
    other prompts); keep the blocks. D's timeout thus measures P's silence, not P's queue."""

    transfer_id: str


class PrefillAck(msgspec.Struct, tag=True):
    """D -> P: D took the KV over; P may free (or prefix-cache) its blocks."""

    transfer_id: str


class PDError(msgspec.Struct, tag=True):
    transfer_id: str
    error: str


ControlMessage = CacheInfo | PrefillDone | LeaseRenew | PrefillAck | PDError


# ---- prefix pulls: an engine <-> a peer's cache service (--enable-kv-pull) ------------------------


class PullBlocks(msgspec.Struct, tag=True):
    """Write the host-tier blocks of this run of hashes, in order and as far as the run goes, into the asker's
    host blocks (one per hash) through one of its endpoints; then answer PullReply."""

    pull_id: str
    fingerprint: str  # the asker's producer (kv/disk_store.fingerprint): blocks of another are never sent
    hashes: list[bytes]
    host_blocks: list[int]
    endpoints: list[Endpoint]
    deadline: float  # unix time: a pull that reaches the holder later writes nothing (the asker gave up)


class PullReply(msgspec.Struct, tag=True):
    pull_id: str
    num_blocks: int  # the leading blocks written (0: none; the asker computes the rest)
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None


PullMessage = PullBlocks | PullReply
