"""The cache messager, prefill side: writes each finished layer of each chunk into D's blocks.

The worker sends, per step, which blocks go where (`StepTransfers`) and then one `LayerDone` per
layer as its forward pass finishes it; the messager writes that layer while the worker computes the
next one (layer-wise streaming). Writes to one decode instance are batched per layer. After the last
layer of a request's final chunk it flushes (the bytes are in D's memory) and reports `TransferDone`;
only then does the engine send D *prefill done*.

With tensor parallelism every rank of the worker sends both, for its heads of the layer; the messager writes
a layer (all heads of its blocks, one byte range per block) once every rank has said it is done.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.disagg.messages import TransferDone
from pdserve.kv.layout import ByteRange, KVLayout, block_ranges, layer_ranges
from pdserve.kv.transfer_plan import LayerDone, MessagerInput, StepTransfers, TransferPlan
from pdserve.transport import CacheBuffer, Endpoint, KVWriter, TransferError, open_writer

log = logging.getLogger("pdserve.cache_messager")


@dataclass
class _Progress:
    deadline: float
    nbytes: int = 0
    first_write: float | None = None
    last_write: float | None = None
    failed: bool = False  # reported already; later chunks of it are skipped


class CacheMessager:
    IDLE_WRITER_SECONDS = 120.0
    def __init__(self, source: CacheBuffer, layout: KVLayout, report: Callable[[TransferDone], None],
                 connect: Callable[[Endpoint, CacheBuffer], KVWriter] = open_writer, ranks: int = 1) -> None:
        self.source = source
        self.layout = layout
        self._places = layout.places()  # a model layer's (group, slot)
        self.report = report
        self._connect = connect
        self._writers: dict[Endpoint, KVWriter] = {}
        self._last_used: dict[Endpoint, float] = {}
        self._steps: dict[int, list[TransferPlan]] = {}
        self.ranks = ranks
        self._ranks_done: dict[tuple[int, int], set[int]] = defaultdict(set)  # (step, layer) -> ranks done with it
        self._finished = 0  # the last step whose every layer was written
        self._progress: dict[str, _Progress] = {}

    def handle(self, msg: MessagerInput) -> None:
        if isinstance(msg, StepTransfers):
            if msg.step_id in self._steps or msg.step_id <= self._finished:  # another rank's copy of it
                return
            self._steps[msg.step_id] = msg.transfers
            for plan in msg.transfers:
                progress = self._progress.setdefault(plan.transfer_id, _Progress(plan.deadline))
                progress.deadline = max(progress.deadline, plan.deadline)
            return
        plans = self._steps.get(msg.step_id)
        if plans is None:
            return
        key = (msg.step_id, msg.layer)
        self._ranks_done[key].add(msg.rank)
        if len(self._ranks_done[key]) < self.ranks:  # ranks send on their own sockets: a next step may come first
            return
        del self._ranks_done[key]
        self._write_layer(plans, msg)
        if msg.layer == len(self._places) - 1:
            self._finished = msg.step_id
            # A step the worker never finished (it failed mid-forward) left an entry; steps run one at a
            # time, so any older entry is such a leftover.
            for old in [s for s in self._steps if s <= msg.step_id]:
                del self._steps[old]
            for old in [k for k in self._ranks_done if k[0] <= msg.step_id]:
                del self._ranks_done[old]
            self._finish_step(plans)

    def extend(self, transfer_id: str, deadline: float) -> None:
        """D's lease was renewed: writes for this transfer may go on until `deadline`."""
        progress = self._progress.get(transfer_id)
        if progress is not None:
            progress.deadline = max(progress.deadline, deadline)

    def drop_gone_writers(self) -> None:
        """Close the writers whose decode instance's cache is gone (called between messages): under ipc
        a dead D's memory stays in use while we map it."""
        for endpoint in [e for e, w in self._writers.items() if w.peer_gone()]:
            log.info("the decode instance's cache %s is gone: closing its writer", endpoint)
            self._drop_writer(endpoint)

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    # ---- internals -------------------------------------------------------------------------

    def _write_layer(self, plans: list[TransferPlan], msg: LayerDone) -> None:
        now = time.time()
        groups: dict[Endpoint, list[tuple[TransferPlan, list[ByteRange]]]] = defaultdict(list)
        for plan in plans:
            progress = self._progress.get(plan.transfer_id)
            if progress is None or progress.failed:
                continue
            if now > progress.deadline:  # the latest renewal, not the (maybe stale) plan's
                self._fail(plan.transfer_id, "the decode instance's lease on its blocks ran out before the KV "
                                             "was written (--pd-transfer-timeout)")
                continue
            ranges = self._ranges(plan, msg.layer)
            if ranges:  # none: D had these blocks already (its own prefix cache)
                groups[plan.endpoint].append((plan, ranges))
        for endpoint, items in groups.items():
            try:
                self._writer(endpoint).write([r for _, ranges in items for r in ranges])
            except TransferError as e:
                self._drop_writer(endpoint)
                for plan, _ in items:
                    self._fail(plan.transfer_id, str(e))
                continue
            done = time.time()
            for plan, ranges in items:
                progress = self._progress[plan.transfer_id]
                progress.nbytes += sum(n for _, _, n in ranges)
                progress.first_write = progress.first_write or done
                progress.last_write = done

    def _ranges(self, plan: TransferPlan, layer: int) -> list[ByteRange]:
        """The layer's slot in its group's blocks; with the first layer, every group's whole blocks."""
        ranges = []
        if layer == 0:
            for pairs in plan.groups:
                k = pairs.num_whole_blocks
                ranges += block_ranges(self.layout, pairs.src_blocks[:k], pairs.dst_blocks[:k])
        group, slot = self._places[layer]
        pairs = plan.group(group)
        k = pairs.num_whole_blocks
        return ranges + layer_ranges(self.layout, pairs.src_blocks[k:], pairs.dst_blocks[k:], slot)

    def _finish_step(self, plans: list[TransferPlan]) -> None:
        ending = [p for p in plans if p.last]
        flushed: dict[Endpoint, str | None] = {}
        for plan in ending:
            progress = self._progress.pop(plan.transfer_id, None)
            if progress is None or progress.failed:
                continue
            if plan.endpoint not in flushed:
                flushed[plan.endpoint] = self._flush(plan.endpoint)
            error = flushed[plan.endpoint]
            if error is not None:
                self.report(TransferDone(plan.transfer_id, False, error))
            else:
                self.report(TransferDone(plan.transfer_id, True, None, progress.nbytes, progress.first_write,
                                         progress.last_write))
        # Failed transfers are kept (to skip their later chunks) until their deadline has passed; so are
        # ones P aborted before their last chunk, which no step will finish.
        now = time.time()
        for tid in [t for t, p in self._progress.items() if now > p.deadline]:
            del self._progress[tid]
        # A decode instance that went away under ipc is never noticed by a write; drop idle writers so
        # its segment is unmapped (and its memory freed) after a while.
        for endpoint in [e for e, t in self._last_used.items() if now - t > self.IDLE_WRITER_SECONDS]:
            self._drop_writer(endpoint)

    def _flush(self, endpoint: Endpoint) -> str | None:
        writer = self._writers.get(endpoint)
        if writer is None:
            return "the connection to the decode instance was lost"
        try:
            writer.flush()
            return None
        except TransferError as e:
            self._drop_writer(endpoint)
            return str(e)

    def _fail(self, transfer_id: str, error: str) -> None:
        progress = self._progress[transfer_id]
        progress.failed = True
        log.warning("transfer %s failed: %s", transfer_id, error)
        self.report(TransferDone(transfer_id, False, error))

    def _writer(self, endpoint: Endpoint) -> KVWriter:
        writer = self._writers.get(endpoint)
        if writer is None:
            writer = self._writers[endpoint] = self._connect(endpoint, self.source)
        self._last_used[endpoint] = time.time()
        return writer

    def _drop_writer(self, endpoint: Endpoint) -> None:
        self._last_used.pop(endpoint, None)
        writer = self._writers.pop(endpoint, None)
        if writer is not None:
            writer.close()
