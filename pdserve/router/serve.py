"""`pdserve router`: run the router until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging

import uvicorn

from pdserve.router.app import build_router_app
from pdserve.router.registry import Registry
from pdserve.utils.process import exit_on_sigterm
from pdserve.utils.uvicorn_run import serve_and_announce


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--instance-expiry", type=float, default=10.0,
                   help="seconds without a registration before an instance is dropped")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds an instance may take to answer")


def serve_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    exit_on_sigterm()
    app = build_router_app(Registry(args.instance_expiry), args.request_timeout)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    asyncio.run(serve_and_announce(
        server, f"pdserve: router on http://{args.host}:{args.port} (instances register at /register)"))
    return 0
