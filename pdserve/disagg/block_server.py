"""Serving this instance's host-tier blocks to peers that pull a prefix (`--enable-kv-pull`), in the cache service.

A peer's engine sends a sealed PullBlocks (the cluster secret, as on the PD control plane) to this ROUTER socket:
a run of block hashes and, for each, a block of its own host tier to write it into. The service knows which of its
host blocks holds which hash (HostBlockIndex: every save and disk read names them; the engine is not asked, so a
pull never waits for a step), writes the leading run it holds into the peer's host segment through a transport
(ipc / tcp / rdma, the peer's endpoints, authenticated as PD writes are), and answers how many it wrote. The peer
computes the rest. A block evicted before the pull reaches it ends the run there; nothing is ever half written
and reported.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from pdserve.disagg.messages import PullBlocks, PullMessage, PullReply
from pdserve.kv.layout import KVLayout, block_ranges
from pdserve.transport import CacheBuffer, KVWriter, TransferError, choose_endpoint, open_writer
from pdserve.utils.cluster_auth import AuthError, ControlSeal, cluster_secret

log = logging.getLogger("pdserve.kv.pull")

MAX_WRITERS = 16  # writers kept open to peers (least recently used closed first)


class HostBlockIndex:
    """Which hash each host block holds now, as the service's own copies made it (and the reverse)."""

    def __init__(self) -> None:
        self._by_block: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}

    def put(self, block: int, block_hash: bytes) -> None:
        if (old := self._by_block.get(block)) is not None and self._by_hash.get(old) == block:
            del self._by_hash[old]
        self._by_block[block] = block_hash
        self._by_hash[block_hash] = block

    def drop(self, block: int) -> None:
        if (old := self._by_block.pop(block, None)) is not None and self._by_hash.get(old) == block:
            del self._by_hash[old]

    def run(self, hashes: list[bytes]) -> list[int]:
        """The host blocks holding the leading run of these hashes."""
        out = []
        for h in hashes:
            if (block := self._by_hash.get(h)) is None:
                break
            out.append(block)
        return out

    def clear(self) -> None:
        self._by_block.clear()
        self._by_hash.clear()


class BlockServer:
    def __init__(self, ctx: zmq.Context, host: str, source: CacheBuffer, layout: KVLayout, fingerprint: str,
                 protocols: list[str], index: HostBlockIndex) -> None:
        self.source, self.layout, self.fingerprint = source, layout, fingerprint
        self.protocols = protocols
        self.index = index
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        self._seal = ControlSeal(cluster_secret())
        self._decoder = msgspec.msgpack.Decoder(PullMessage)
        self._encoder = msgspec.msgpack.Encoder()
        self._writers: dict[bytes, KVWriter] = {}  # by the endpoint's encoding
        self.refused = 0  # requests that were not sealed with the cluster secret, or not ours

    def handle_waiting(self) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.refused += 1
                continue
            identity, raw = frames
            try:
                msg = self._decoder.decode(self._seal.open(raw))
            except (AuthError, msgspec.DecodeError) as e:
                self.refused += 1
                log.warning("refused a pull request: %s", e)
                continue
            if isinstance(msg, PullBlocks):
                reply = self._serve(msg)
                self.socket.send_multipart([identity, self._seal.seal(self._encoder.encode(reply))], zmq.NOBLOCK)

    def _serve(self, msg: PullBlocks) -> PullReply:
        start = time.perf_counter()
        if time.time() > msg.deadline:
            return PullReply(msg.pull_id, 0, error="arrived after its deadline")
        if msg.fingerprint != self.fingerprint:
            return PullReply(msg.pull_id, 0, error="another producer's blocks (weights, KV dtype or layout differ)")
        blocks = self.index.run(msg.hashes[:len(msg.host_blocks)])
        if not blocks:
            return PullReply(msg.pull_id, 0)
        endpoint = choose_endpoint(self.protocols, msg.endpoints)
        if endpoint is None:
            return PullReply(msg.pull_id, 0, error="no transport in common")
        try:
            writer = self._writer(endpoint)
            nbytes = writer.write(block_ranges(self.layout, blocks, msg.host_blocks[:len(blocks)]))
            writer.flush()
        except TransferError as e:
            self._drop_writer(endpoint)
            log.warning("a pull of %d blocks failed: %s", len(blocks), e)
            return PullReply(msg.pull_id, 0, error=str(e))
        return PullReply(msg.pull_id, len(blocks), nbytes, time.perf_counter() - start)

    def _writer(self, endpoint: object) -> KVWriter:
        key = msgspec.msgpack.encode(endpoint)
        writer = self._writers.pop(key, None)
        if writer is not None and writer.peer_gone():
            writer.close()
            writer = None
        if writer is None:
            writer = open_writer(endpoint, self.source)
        self._writers[key] = writer  # most recently used last
        while len(self._writers) > MAX_WRITERS:
            self._writers.pop(next(iter(self._writers))).close()
        return writer

    def _drop_writer(self, endpoint: object) -> None:
        if (writer := self._writers.pop(msgspec.msgpack.encode(endpoint), None)) is not None:
            writer.close()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
        self.socket.close()
