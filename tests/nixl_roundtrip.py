"""The rdma (NIXL) transport between two processes, run by tests/test_kv_transfer.py in a process of its
own (UCX can crash an interpreter's teardown, so both processes leave with exit_now).

    python -m tests.nixl_roundtrip   # prints "ok" and exits 0, or says what went wrong and exits 1

D (a spawned process) registers its cache and hands over its endpoint; P writes block and layer
ranges and flushes; D checks every byte. Then: a range past D's cache is refused, and once D is gone
a write to it fails (TransferError) instead of hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

import msgspec

from pdserve.kv.layout import KVLayout, block_ranges, layer_ranges

LAYOUT = KVLayout(num_blocks=12, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
D_BLOCKS = 9


def decode_side(to_p: mp.Queue, from_p: mp.Queue) -> None:
    from pdserve.kv.cache import KVCache
    from pdserve.transport import CacheBuffer, start_receiver
    from pdserve.transport.ipc import buffer_address
    from pdserve.transport.nixl import exit_now, release

    d = KVCache.create_shared(LAYOUT.with_blocks(D_BLOCKS))
    receiver = start_receiver("rdma", CacheBuffer(d.shm.buf, buffer_address(d.shm.buf)), d.shm_name, "127.0.0.1")
    to_p.put(msgspec.msgpack.encode(receiver.endpoint))
    expected = from_p.get()  # P wrote: {dst block: src block} and the layer range
    import torch

    source = torch.arange(LAYOUT.num_blocks * d.tensor[0].numel(), dtype=torch.float32).view(
        LAYOUT.num_blocks, *d.tensor.shape[1:])
    ok = all(torch.equal(d.tensor[dst], source[src]) for dst, src in expected["blocks"].items())
    ok = ok and torch.equal(d.tensor[8, 2], source[10, 2]) and not d.tensor[8, :2].any()
    ok = ok and not d.tensor[[2, 3, 4, 6, 7]].any()
    to_p.put(ok)
    to_p.close()
    to_p.join_thread()  # the queue's feeder thread must deliver before exit_now ends the process
    release()
    d.close()
    exit_now(0)


def main() -> int:
    import torch

    from pdserve.kv.cache import KVCache
    from pdserve.transport import CacheBuffer, Endpoint, TransferError, open_writer
    from pdserve.transport.ipc import buffer_address
    from pdserve.transport.nixl import exit_now, release

    ctx = mp.get_context("spawn")
    to_p, from_p = ctx.Queue(), ctx.Queue()
    d = ctx.Process(target=decode_side, args=(to_p, from_p))
    d.start()
    p = KVCache.create_shared(LAYOUT)
    p.tensor.copy_(torch.arange(p.tensor.numel(), dtype=torch.float32).view_as(p.tensor))
    endpoint = msgspec.msgpack.decode(to_p.get(timeout=60), type=Endpoint)
    writer = open_writer(endpoint, CacheBuffer(p.shm.buf, buffer_address(p.shm.buf)))
    failures = []
    ranges = block_ranges(LAYOUT, [2, 3, 7], [0, 1, 5]) + layer_ranges(LAYOUT, [10], [8], 2)
    if writer.write(ranges) != 3 * LAYOUT.block_bytes + LAYOUT.layer_block_bytes:
        failures.append("write() did not count the bytes")
    writer.flush()
    from_p.put({"blocks": {0: 2, 1: 3, 5: 7}})
    if not to_p.get(timeout=60):
        failures.append("D's cache does not hold exactly the bytes written")
    try:
        writer.write([(0, D_BLOCKS * LAYOUT.block_bytes, 8)])
        failures.append("a range past D's cache was not refused")
    except TransferError:
        pass
    d.join(30)
    start = time.monotonic()
    try:  # D has exited: its memory is gone
        writer.write(block_ranges(LAYOUT, [0], [0]))
        writer.flush()
        failures.append("a write to an exited decode process did not fail")
    except TransferError:
        if time.monotonic() - start > 35:
            failures.append("a write to an exited decode process took more than 35 s to fail")
    writer.close()
    release()
    p.close()
    print("ok" if not failures else "\n".join(failures), flush=True)
    exit_now(1 if failures else 0)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
