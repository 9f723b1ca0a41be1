"""Worker process entry: `python -m pdserve.worker --config B64 --address ipc://... [--rank R --rendezvous PATH]`.

One process per tensor-parallel rank; each has its own socket to the engine and the same messages.

Messages: -> WorkerLoaded (weights in, block count known); <- CacheCommand (create the cache, or
attach to the cache service's); -> WorkerReady; then steps until WorkerShutdown.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

import msgspec
import zmq

from pdserve.config.engine import EngineConfig
from pdserve.config.errors import ModelLoadError
from pdserve.utils.memory import keep_freed_memory
from pdserve.utils.process import child_entry, exit_now, recv_until_stopped
from pdserve.worker import core_loan
from pdserve.worker.protocol import (
    CacheCommand,
    CalibrateCommand,
    ExecuteStep,
    LoRACommand,
    WorkerError,
    WorkerInput,
    WorkerShutdown,
)

if TYPE_CHECKING:  # torch is imported only once the process has started
    from pdserve.worker.worker import Worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--rendezvous", help="the file the tensor-parallel ranks meet through")
    args = child_entry("worker", parser, argv)
    config = EngineConfig.decode(args.config)
    keep_freed_memory()  # every step frees and allocates the same large temporaries again
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(args.address)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(WorkerInput)
    worker = tp = None
    try:
        from pdserve.worker.ranks import join_ranks, leave_ranks
        from pdserve.worker.worker import Worker

        try:
            tp = join_ranks(args.rank, config.tensor_parallel_size, args.rendezvous, config.device,
                            config.startup_timeout)
            worker = Worker(config, ctx, tp)
            sock.send(encoder.encode(worker.loaded_message()))
            command = decoder.decode(recv_until_stopped(sock))
            if isinstance(command, WorkerShutdown):
                return 0
            if not isinstance(command, CacheCommand):
                raise RuntimeError(f"expected a CacheCommand, got {type(command).__name__}")
            sock.send(encoder.encode(worker.setup_cache(command)))
        except (ModelLoadError, ValueError, RuntimeError, MemoryError, OSError) as e:
            sock.send(encoder.encode(WorkerError(error=str(e))))
            return 1
        loan = core_loan.from_env()  # pdserve launch: a prefill worker lends its cores to a decode worker
        while not isinstance(msg := decoder.decode(recv_until_stopped(sock)), WorkerShutdown):
            sock.send(encoder.encode(_answer(worker, msg, loan)))
        return 0
    finally:
        if worker is not None:
            worker.close()
        if tp is not None:
            leave_ranks(tp)
        sock.close()
        ctx.term()


def _answer(worker: Worker, msg: WorkerInput, loan: core_loan.Lender | core_loan.Borrower | None) -> msgspec.Struct:
    """A command's reply; a failure is reported (WorkerError) and the worker keeps serving: the engine fails
    this step's requests."""
    try:
        if isinstance(msg, ExecuteStep):
            return loan.run(lambda: worker.execute(msg)) if loan else worker.execute(msg)
        if isinstance(msg, CalibrateCommand):
            return loan.run_timed(lambda each: worker.calibrate(msg, each)) if loan else worker.calibrate(msg)
        if isinstance(msg, LoRACommand):
            try:
                return worker.lora(msg)
            except (ValueError, OSError) as e:  # a bad adapter: the caller's 400, no traceback
                return WorkerError(error=str(e))
        return worker.weights(msg)
    except Exception as e:
        logging.exception("step failed")
        return WorkerError(error=f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    exit_now(main())
