"""Prefix pulls this instance asks for (`--enable-kv-pull`), in the cache service.

The engine sends PullFrom (a peer's block server, a run of hashes, the host blocks to fill, a deadline); this
service stops serving those host blocks, sends a sealed PullBlocks with its own host segment's endpoints to the
peer (a DEALER per peer, never blocking), and once the peer answers, indexes the blocks written and reports
PullDone to the engine. A peer that never answers is the engine's timeout; its late answer is dropped here.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from pdserve.disagg.block_server import HostBlockIndex
from pdserve.disagg.messages import PullBlocks, PullDone, PullFrom, PullMessage, PullReply
from pdserve.transport import Endpoint
from pdserve.utils.cluster_auth import AuthError, ControlSeal, cluster_secret
from pdserve.utils.zmq_waiting import waiting

log = logging.getLogger("pdserve.kv.pull")

MAX_PEERS = 64  # DEALERs kept open (least recently used closed first)


class PrefixPulls:
    def __init__(self, ctx: zmq.Context, index: HostBlockIndex, fingerprint: str, endpoints: list[Endpoint]) -> None:
        self._ctx, self.index, self.fingerprint, self.endpoints = ctx, index, fingerprint, endpoints
        self._seal = ControlSeal(cluster_secret())
        self._decoder = msgspec.msgpack.Decoder(PullMessage)
        self._encoder = msgspec.msgpack.Encoder()
        self._dealers: dict[str, zmq.Socket] = {}
        self._pending: dict[str, PullFrom] = {}
        self._forgotten: set[str] = set()  # pulls in flight when the host tier was reset: never indexed
        self.refused = 0  # answers that were not sealed with the cluster secret

    @property
    def sockets(self) -> list[zmq.Socket]:
        return list(self._dealers.values())

    def start(self, msg: PullFrom) -> PullDone | None:
        """Send the request; a PullDone now if it cannot go."""
        for block in msg.host_blocks:
            self.index.drop(block)  # about to be overwritten by the peer
        request = PullBlocks(msg.pull_id, self.fingerprint, msg.hashes, msg.host_blocks, self.endpoints, msg.deadline)
        try:
            self._dealer(msg.addr).send(self._seal.seal(self._encoder.encode(request)), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            return PullDone(msg.pull_id, 0, error=f"could not ask {msg.addr}: {e}")
        self._pending[msg.pull_id] = msg
        return None

    def answers(self) -> list[PullDone]:
        """The peers' answers waiting now, as reports for the engine (blocks written are served from now on)."""
        out = []
        for addr, dealer in list(self._dealers.items()):
            for raw in waiting(dealer):
                try:
                    reply = self._decoder.decode(self._seal.open(raw))
                except (AuthError, msgspec.DecodeError) as e:
                    self.refused += 1
                    log.warning("refused a pull answer from %s: %s", addr, e)
                    continue
                if isinstance(reply, PullReply) and (done := self._finish(reply)) is not None:
                    out.append(done)
        self._expire()
        return out

    def _finish(self, reply: PullReply) -> PullDone | None:
        asked = self._pending.pop(reply.pull_id, None)
        if asked is None:
            return None
        n = max(0, min(reply.num_blocks, len(asked.host_blocks)))
        if reply.pull_id in self._forgotten:  # asked before a reset: its blocks are not served
            self._forgotten.discard(reply.pull_id)
        else:
            for block, block_hash in zip(asked.host_blocks[:n], asked.hashes, strict=False):
                self.index.put(block, block_hash)
        if reply.error:
            log.warning("a prefix pull from %s wrote %d of %d blocks: %s", asked.addr, n, len(asked.hashes),
                        reply.error)
        return PullDone(reply.pull_id, n, reply.nbytes, reply.error, reply.seconds)

    def forget(self) -> None:
        """The host tier was reset: what pulls in flight bring is not served to peers."""
        self._forgotten |= set(self._pending)

    def _expire(self) -> None:
        """Pulls whose deadline passed long ago: the engine gave up on them; their answers will be dropped."""
        now = time.time()
        for pull_id in [i for i, m in self._pending.items() if now > m.deadline + 60]:
            del self._pending[pull_id]
            self._forgotten.discard(pull_id)

    def _dealer(self, addr: str) -> zmq.Socket:
        dealer = self._dealers.pop(addr, None)
        if dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"tcp://{addr}")
        self._dealers[addr] = dealer
        while len(self._dealers) > MAX_PEERS:
            self._dealers.pop(next(iter(self._dealers))).close()
        return dealer

    def close(self) -> None:
        for dealer in self._dealers.values():
            dealer.close()
        self._dealers.clear()
