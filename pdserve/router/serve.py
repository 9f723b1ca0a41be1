"""`pdserve router`: run the router until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

import yaml
from pydantic import ValidationError

from pdserve.deploy.cluster_auth import ENV
from pdserve.http.wire import Registration
from pdserve.router.app import RouterSettings, build_router_app
from pdserve.router.policies import POLICIES
from pdserve.router.prefill_decider import PD_POLICIES
from pdserve.router.prompt import PromptReader
from pdserve.utils.process import exit_on_sigterm
from pdserve.utils.uvicorn_run import LateListeningServer, listening_socket, serve_and_announce, server_config

log = logging.getLogger("pdserve.router")


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--reuse-port", action="store_true",
                   help="share --port with other routers of the deployment (SO_REUSEPORT): the kernel spreads "
                        "connections among them, so one router's death refuses no connection")
    p.add_argument("--own-port", type=int, default=None,
                   help="a second port only this router listens on, for registrations and /metrics when several "
                        "routers share --port (instances list every router's own port in their --router)")
    p.add_argument("--prefill-policy", choices=POLICIES, default="least_tokens")
    p.add_argument("--decode-policy", choices=POLICIES, default="least_requests",
                   help="also picks among mixed instances")
    p.add_argument("--pd-policy", choices=PD_POLICIES, default="always",
                   help="always: every prompt is computed on a prefill instance; conditional: on the decode "
                        "instance when what it lacks of the prompt is at most --max-local-prefill-length tokens, "
                        "or when the prefill instance is backed up (Dynamo's disaggregated router)")
    p.add_argument("--max-local-prefill-length", type=int, default=256,
                   help="conditional: uncached prompt tokens a decode instance computes itself")
    p.add_argument("--max-prefill-queue-tokens", type=int, default=4096,
                   help="conditional: the prefill instance's in-flight prompt tokens from which prompts are "
                        "computed on the decode instance instead")
    p.add_argument("--local-prefill-decode-requests", type=int, default=-1,
                   help="conditional: a decode instance with at most this many requests in flight computes any "
                        "prompt itself (-1: never for this reason; pdserve launch, whose decode instance borrows "
                        "the prefill instance's cores while it is idle, sets it)")
    p.add_argument("--mixed-fallback", action="store_true",
                   help="send requests to mixed instances when no complete prefill/decode pair is healthy "
                        "(without prefill/decode instances at all, mixed ones always serve)")
    p.add_argument("--max-retries", type=int, default=2,
                   help="tries on other instances when one fails before the client has seen a byte")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="times a stream whose instance fails mid-answer is resumed on another route where the "
                        "client is (Dynamo's name; 0: the stream ends with an error event)")
    p.add_argument("--instances", type=Path, default=None,
                   help="YAML file with a static list of instances (each: role, url, and for PD the fields "
                        "instances register: pd_comm, transports, host_id, compatibility_key, block_size)")
    p.add_argument("--instance-expiry", type=float, default=10.0,
                   help="seconds without a heartbeat before a registered instance is forgotten")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between /health probes")
    p.add_argument("--health-timeout", type=float, default=2.0)
    p.add_argument("--health-failure-threshold", type=int, default=3,
                   help="failed probes in a row that take an instance out of the pool")
    p.add_argument("--health-success-threshold", type=int, default=2,
                   help="good probes in a row that bring it back")
    p.add_argument("--cache-balance-abs", type=int, default=4096,
                   help="cache_aware: in-flight token gap between instances that counts as imbalance")
    p.add_argument("--cache-balance-rel", type=float, default=1.5,
                   help="cache_aware: ... and load ratio; imbalanced, it routes by least tokens")
    p.add_argument("--cache-min-match", type=float, default=0.3,
                   help="cache_aware: prefix share below which it routes by least tokens")
    p.add_argument("--tokenizer", default=None,
                   help="model path whose tokenizer reads prompts (default: the embedded model); 'none' "
                        "estimates token counts from text and disables cache_aware")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="clients must send 'Authorization: Bearer KEY' (default: $PDSERVE_API_KEY)")
    p.add_argument("--cluster-secret", default=os.environ.get(ENV),
                   help=f"instances must sign registrations with it (default: ${ENV})")
    p.add_argument("--max-request-bytes", type=int, default=16 << 20, help="larger request bodies get 413")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds an instance may take to answer")


JOIN_TIMEOUT_S = 10.0  # a router sharing its port waits at most this long for a route before it joins


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    return RouterSettings(
        prefill_policy=args.prefill_policy, decode_policy=args.decode_policy, mixed_fallback=args.mixed_fallback,
        max_retries=args.max_retries, migration_limit=args.migration_limit, request_timeout=args.request_timeout,
        instance_expiry=args.instance_expiry,
        health_interval=args.health_interval, health_timeout=args.health_timeout,
        fail_threshold=args.health_failure_threshold, success_threshold=args.health_success_threshold,
        api_key=args.api_key, cluster_secret=(args.cluster_secret or "").encode(),
        max_request_bytes=args.max_request_bytes,
        cache_aware={"balance_abs": args.cache_balance_abs, "balance_rel": args.cache_balance_rel,
                     "min_match": args.cache_min_match},
        pd_policy=args.pd_policy, max_local_prefill_length=args.max_local_prefill_length,
        max_prefill_queue_tokens=args.max_prefill_queue_tokens,
        local_prefill_decode_requests=args.local_prefill_decode_requests,
        static_instances=load_static_instances(args.instances) if args.instances else [])


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
    settings = settings_from_args(args)
    if not settings.cluster_secret and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("no --cluster-secret: anyone who reaches %s:%d can register an instance", args.host, args.port)
    app = build_router_app(settings, prompt_reader(args.tokenizer, (args.prefill_policy, args.decode_policy)))
    server = LateListeningServer(server_config(app, args.host, args.port))
    shared = listening_socket(args.host, args.port, args.reuse_port)
    announcement = (f"pdserve: router on http://{args.host}:{args.port} (instances register at /register; "
                    f"policies: prefill {args.prefill_policy}, decode {args.decode_policy}, pd {args.pd_policy})")
    if args.own_port is None:
        asyncio.run(serve_and_announce(server, announcement, [shared]))
        return 0

    async def both() -> None:
        # Its own port at once (instances register there); the shared one once it can route, so that
        # a restarted router takes no connection it would answer with 503 (at most JOIN_TIMEOUT_S later).
        late = asyncio.create_task(server.listen_when(shared, app.state.can_serve, JOIN_TIMEOUT_S))
        await serve_and_announce(server, announcement.replace(" (", f", its own port {args.own_port} (", 1),
                                 [listening_socket(args.host, args.own_port)])
        late.cancel()

    asyncio.run(both())
    return 0
