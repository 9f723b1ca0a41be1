"""`pdserve router`: run the router until Ctrl-C or SIGTERM (its flags: settings.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

import yaml
from pydantic import ValidationError

from pdserve.admission.settings import admission_from_flags
from pdserve.config.flags import from_args
from pdserve.http.wire import Registration
from pdserve.router.app import build_router_app
from pdserve.router.prompt import PromptReader
from pdserve.router.settings import RouterSettings
from pdserve.utils.process import die_with_parent, exit_on_sigterm
from pdserve.utils.uvicorn_run import LateListeningServer, listening_socket, serve_and_announce, server_config

log = logging.getLogger("pdserve.router")

JOIN_TIMEOUT_S = 10.0  # a router sharing its port waits at most this long for a route before it joins


def load_static_instances(path: Path) -> list[Registration]:
    """`instances:` in a YAML file: a list of registrations (role and url at least)."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
        return [Registration.model_validate(item) for item in data.get("instances", [])]
    except (OSError, yaml.YAMLError, ValidationError, AttributeError) as e:
        raise SystemExit(f"pdserve router: cannot read the instance list {path}: {e}") from None


def prompt_reader(tokenizer: str | None, policies: tuple[str, str]) -> PromptReader:
    if tokenizer == "none":
        if "cache_aware" in policies:
            raise SystemExit("pdserve router: cache_aware needs a tokenizer (not --tokenizer none)")
        return PromptReader(None)
    from pdserve.loader import resolve_model_folder
    from pdserve.tokenization.tokenizer import Tokenizer
    from pdserve.utils.memory import release_freed_memory

    reader = PromptReader(Tokenizer(resolve_model_folder(tokenizer)))
    release_freed_memory()  # what parsing tokenizer.json left in the heap
    return reader


def serve_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    exit_on_sigterm()
    if "PDSERVE_PARENT_PID" in os.environ:  # started by `pdserve launch` (or its Ray actor): do not outlive it
        die_with_parent()
    settings = from_args(RouterSettings, args)
    try:
        admission_from_flags(settings.ttft_slo_ms, settings.tpot_slo_ms, settings.rate_limit)
    except ValueError as e:
        raise SystemExit(f"pdserve router: {e}") from None
    static = load_static_instances(settings.instances) if settings.instances else []
    host, port = settings.host, settings.port
    if not settings.cluster_secret and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("no --cluster-secret: anyone who reaches %s:%d can register an instance", host, port)
    app = build_router_app(settings, prompt_reader(settings.tokenizer, (settings.prefill_policy,
                                                                        settings.decode_policy)), static)
    server = LateListeningServer(server_config(app, host, port))
    shared = listening_socket(host, port, settings.reuse_port)
    announcement = (f"pdserve: router on http://{host}:{port} (instances register at /register; policies: "
                    f"prefill {settings.prefill_policy}, decode {settings.decode_policy}, pd {settings.pd_policy})")
    if settings.own_port is None:
        asyncio.run(serve_and_announce(server, announcement, [shared]))
        return 0

    async def both() -> None:
        # Its own port at once (instances register there); the shared one once it can route, so that
        # a restarted router takes no connection it would answer with 503 (at most JOIN_TIMEOUT_S later).
        late = asyncio.create_task(server.listen_when(shared, app.state.can_serve, JOIN_TIMEOUT_S))
        await serve_and_announce(server, announcement.replace(" (", f", its own port {settings.own_port} (", 1),
                                 [listening_socket(host, settings.own_port)])
        late.cancel()

    asyncio.run(both())
    return 0
