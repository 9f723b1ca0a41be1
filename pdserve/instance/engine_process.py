"""The engine process of an instance, put together: `python -m pdserve.instance.engine_process --config B64
--input ADDR --output ADDR --sockdir DIR` (engine/engine_client.py starts it).

Starts the worker (and, per the startup truth table, the cache service), waits until the KV cache
exists and both are attached, then serves the frontend. Any failure is reported to the frontend as
EngineDead before the process exits.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import zmq

from pdserve.config.engine import EngineConfig
from pdserve.engine.messages import EngineDead, EngineReady
from pdserve.instance.build import build_engine_core
from pdserve.instance.startup import start_processes
from pdserve.utils.process import child_entry, parent_gone, when_parent_gone

if TYPE_CHECKING:
    from pdserve.engine.engine_core import EngineCore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--model-name", default="")
    parser.add_argument("--sockdir", required=True,
                        help="folder for the worker's and cache service's sockets, inside the client's own: "
                             "the client removes it even when this process is killed")
    args = child_entry("engine", parser, argv)
    config = EngineConfig.decode(args.config)
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(args.input)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(args.output)
    encoder = msgspec.msgpack.Encoder()
    started = core = None
    sockdir = Path(args.sockdir)
    sockdir.mkdir(mode=0o700, exist_ok=True)
    # its client was killed: nobody else removes the client's IPC folder
    when_parent_gone(lambda: shutil.rmtree(sockdir.parent, ignore_errors=True))
    try:
        started = start_processes(config, ctx, str(sockdir))
        layout = started.layout
        core = build_engine_core(config, started, ctx)
        outputs.send(encoder.encode(EngineReady(
            layout.num_blocks, config.block_size, started.max_model_len, args.model_name, started.profile,
            config.splitwise_role, core.connector.port, list(config.cache_transfer_protocol), started.log.events,
            layout.compatibility_key(args.model_name), *_kv_event_endpoints(core), started.pull_port,
            core.connector.sides, core.utilities.stats())))
        core.run(inputs, outputs)
        return 0
    except Exception as e:  # anything: the frontend must hear why the engine is gone
        from pdserve.utils.child_process import ChildDied

        log = logging.getLogger("pdserve.engine")
        if isinstance(e, ChildDied):  # the child already said why; no traceback of ours helps
            log.error("%s", e)
        else:
            log.exception("engine failed")
        outputs.send(encoder.encode(EngineDead(error=str(e))))
        return 1
    finally:
        if parent_gone():  # nobody reads what is left to send
            outputs.setsockopt(zmq.LINGER, 0)
            shutil.rmtree(sockdir.parent, ignore_errors=True)
        if core is not None:
            core.connector.close()
            if core.kv_events is not None:
                core.kv_events.close()
        if started is not None:
            started.shutdown()
        inputs.close()
        outputs.close()
        ctx.term()
        shutil.rmtree(sockdir, ignore_errors=True)


def _kv_event_endpoints(core: EngineCore) -> tuple[str | None, str | None]:
    events = core.kv_events
    return (None, None) if events is None else (events.endpoint, events.replay_endpoint)


if __name__ == "__main__":
    sys.exit(main())
