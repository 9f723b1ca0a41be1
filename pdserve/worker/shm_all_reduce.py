"""The all-reduce of an instance's tensor-parallel ranks on a CPU host, through one shared-memory segment
(the kernel: kernels/csrc/shm_all_reduce.cpp). gloo, over loopback sockets, is the fallback when the kernels
are not built; a tensor larger than a slot goes through in slot-sized pieces.

Rank 0 creates the segment, the others map it, and once all have it rank 0 unlinks its name: the memory
lives exactly as long as the ranks do, and a killed rank leaves nothing in /dev/shm.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from pdserve.utils.shm_segment import attach_segment, create_segment, release_segment

log = logging.getLogger("pdserve.worker")
SLOT_BYTES = 8 << 20  # per rank and parity: a 2,048-token step of a 2,048-wide bf16 model in one piece
FLAG_STRIDE = 16  # int64s per rank's flag: 128 bytes, its own cache lines


class ShmAllReduce:
    def __init__(self, rank: int, ranks: int, ops: object, slot_bytes: int = SLOT_BYTES) -> None:
        self.rank, self.ranks, self.ops = rank, ranks, ops
        flag_bytes = ranks * FLAG_STRIDE * 8
        nbytes = flag_bytes + 2 * ranks * slot_bytes
        created = create_segment(nbytes) if rank == 0 else None
        if created is not None:
            _broadcast_name(created.name)
            self._shm = created
        else:
            self._shm = attach_segment(_broadcast_name(None))
        dist.barrier()  # every rank has it mapped
        if created is not None:
            created.unlink()
        buf = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
        self.flags = buf[:flag_bytes].view(torch.int64).view(ranks, FLAG_STRIDE)
        self.slots = buf[flag_bytes:].view(2, ranks, slot_bytes)
        self.slot_bytes = slot_bytes
        pids = torch.tensor([os.getpid()])
        gathered = [torch.zeros_like(pids) for _ in range(ranks)]
        dist.all_gather(gathered, pids)
        self.pids = torch.cat(gathered)
        self.parent = os.getppid()
        self.seq = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place (x is contiguous: a projection's output)."""
        flat = x.view(-1)
        per_piece = self.slot_bytes // x.element_size()
        if flat.numel() <= per_piece:  # a decode step's, and most prefills': one call
            self.seq += 1
            self.ops.shm_all_reduce(flat, self.slots, self.flags, self.pids, self.rank, self.seq, self.parent)
            return x
        for start in range(0, flat.numel(), per_piece):
            self.seq += 1
            self.ops.shm_all_reduce(flat[start:start + per_piece], self.slots, self.flags, self.pids, self.rank,
                                    self.seq, self.parent)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's [rows, cols] side by side, [rows, ranks * cols]; the other ranks: None."""
        rows, cols = x.shape
        out = torch.empty(rows, self.ranks * cols, dtype=x.dtype) if self.rank == 0 else x
        per_piece = max(1, self.slot_bytes // (cols * x.element_size()))
        for start in range(0, rows, per_piece):
            self.seq += 1
            self.ops.shm_gather(x[start:start + per_piece], out[start:start + per_piece], self.slots, self.flags,
                                self.pids, self.rank, self.seq, self.parent)
        return out if self.rank == 0 else None

    def close(self) -> None:
        self.flags = self.slots = None  # type: ignore[assignment]
        if self._shm is not None:
            release_segment(self._shm, owner=False)
            self._shm = None


def _broadcast_name(name: str | None, size: int = 128) -> str:
    """Rank 0's segment name to every rank (bytes in a tensor over the process group; no pickle)."""
    buf = torch.zeros(size, dtype=torch.uint8)
    if name is not None:
        data = name.encode()
        buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return bytes(buf.tolist()).rstrip(b"\0").decode()
