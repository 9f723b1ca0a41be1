"""Engine process entry: `python -m pdserve.engine --config B64 --input ADDR --output ADDR`.

Starts the worker, waits until it has loaded the model and created the KV cache, then serves the
frontend. Any failure is reported to the frontend as EngineDead before the process exits.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import msgspec
import zmq

from pdserve.config import EngineConfig
from pdserve.engine.messages import EngineDead, EngineReady
from pdserve.utils.process import die_with_parent, exit_on_sigterm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--model-name", default="")
    args = parser.parse_args(argv)
    die_with_parent()
    exit_on_sigterm()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    config = EngineConfig.decode(args.config)
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(args.input)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(args.output)
    encoder = msgspec.msgpack.Encoder()
    worker = None
    sockdir = tempfile.TemporaryDirectory(prefix="pdserve-engine-")
    try:
        from pdserve.engine.engine_core import EngineCore
        from pdserve.engine.worker_client import WorkerClient

        worker = WorkerClient(config, ctx, f"ipc://{Path(sockdir.name) / 'worker'}")
        ready = worker.wait_ready(config.startup_timeout)
        core = EngineCore(config, worker, ready.num_blocks, ready.max_model_len, ready.vocab_size)
        outputs.send(encoder.encode(EngineReady(ready.num_blocks, config.block_size, ready.max_model_len,
                                                args.model_name, ready.profile)))
        core.run(inputs, outputs)
        return 0
    except Exception as e:  # anything: the frontend must hear why the engine is gone
        from pdserve.engine.worker_client import WorkerDied

        log = logging.getLogger("pdserve.engine")
        if isinstance(e, WorkerDied):  # the worker already said why; no traceback of ours helps
            log.error("%s", e)
        else:
            log.exception("engine failed")
        outputs.send(encoder.encode(EngineDead(error=str(e))))
        return 1
    finally:
        if worker is not None:
            worker.shutdown()
        inputs.close()
        outputs.close()
        ctx.term()
        sockdir.cleanup()


if __name__ == "__main__":
    sys.exit(main())
