"""`pdserve serve`: start the engine, then the HTTP server; stop both on Ctrl-C or SIGTERM (the server's
flags: settings.py)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import uvicorn

from pdserve.admission.metrics import AdmissionMetrics
from pdserve.admission.predictor import SLO
from pdserve.admission.rate_limit import RateLimits
from pdserve.admission.settings import admission_from_flags
from pdserve.api.admission import ServerAdmission
from pdserve.api.async_engine import AsyncEngine
from pdserve.api.data_parallel import DataParallelEngine, EngineRank
from pdserve.api.lora import LoRAServing
from pdserve.api.metrics import ServerMetrics
from pdserve.api.prompt_work import PromptWork
from pdserve.api.role_change import RoleChanger
from pdserve.api.sampling_defaults import load_sampling_defaults
from pdserve.api.server import build_app
from pdserve.api.settings import ServerSettings
from pdserve.api.state import ServerState
from pdserve.config.engine import EngineConfig
from pdserve.config.engine_args import engine_config_from_args
from pdserve.config.fastdeploy_flags import fastdeploy_refusals
from pdserve.config.flags import from_args
from pdserve.config.kv_events import on_free_ports
from pdserve.config.roles import Role
from pdserve.engine.engine_client import EngineClient
from pdserve.engine.messages import EngineReady
from pdserve.http.wire import KVEventSource, Registration
from pdserve.loader import model_name, resolve_model_folder, tensor_parallel_refusal
from pdserve.tokenization.tokenizer import Tokenizer
from pdserve.transport.base import HOST_ID_ENV, host_id
from pdserve.utils.cluster_auth import ENV
from pdserve.utils.cores import core_share, my_cores, visible_gpus
from pdserve.utils.dtype_names import gpu_present
from pdserve.utils.memory import release_freed_memory
from pdserve.utils.process import die_with_parent, exit_on_sigterm
from pdserve.utils.shm_room import free_host_memory
from pdserve.utils.uvicorn_run import listening_socket, serve_and_announce, server_config

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from pdserve.api.tracing import InstanceTracing

log = logging.getLogger("pdserve.serve")


# The ready-to-paste request: a low temperature, since a small model at temperature 1 rambles.
DEMO_REQUEST = '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32, "temperature": 0.2}'


def advertised_host(host: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    if host not in ("0.0.0.0", "::", ""):
        return host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent; this picks the route's address
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Door:
    """What `serve` settled before the engine starts: its settings and engine config (the flags read once), the
    sockets it holds, and the model's name and folder (resolved once)."""

    settings: ServerSettings
    config: EngineConfig
    http_socket: socket.socket
    metrics_port: int
    metrics_reservation: socket.socket
    advertise: str
    name: str
    folder: Path
    slo: SLO
    rate_limits: RateLimits | None


def serve(args: argparse.Namespace) -> int:
    _settle_process()
    settings = from_args(ServerSettings, args)
    _export_secrets(settings)
    if refusals := _refusals(args, settings):
        raise ValueError("\n".join(refusals))
    tracing = instance_tracing(settings)  # before the model loads: a missing SDK fails at once
    door = _open_door(args, settings)
    engine = start_engines(door.config, door.name, settings.data_parallel_size, args.pd_comm_port or [])
    try:
        state = _server_state(door, engine, tracing)
        from prometheus_client import start_http_server

        state.metrics.seed(engine)
        door.metrics_reservation.close()
        start_http_server(door.metrics_port, addr=settings.host, registry=state.metrics.registry)
        server = uvicorn.Server(server_config(build_app(state), settings.host, settings.port))
        state.request_shutdown = lambda: setattr(server, "should_exit", True)
        ready = engine.ready
        asyncio.run(serve_and_announce(server, _announcement(settings.host, settings.port, door.metrics_port,
                                                             door.name, ready.role, ready.pd_comm_port,
                                                             settings.data_parallel_size),
                                       sockets=[door.http_socket]))
    finally:
        engine.close()
        door.http_socket.close()
        state.metrics.seed(engine)
        door.metrics_reservation.close()
        if tracing is not None:
            tracing.tracing.shutdown()
    return state.exit_code


def _settle_process() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per router registration
    # uvicorn re-raises SIGTERM after its graceful shutdown; as SystemExit it unwinds through the
    # `finally` of serve, so the engine is stopped (not orphaned) and its IPC directory removed.
    exit_on_sigterm()
    if "PDSERVE_PARENT_PID" in os.environ:  # started by `pdserve launch`: do not outlive it
        die_with_parent()


def _export_secrets(settings: ServerSettings) -> None:
    """Children (engine, cache service) read these from the environment."""
    if settings.cluster_secret:
        os.environ[ENV] = settings.cluster_secret
    if settings.host_id:
        os.environ[HOST_ID_ENV] = settings.host_id


def _refusals(args: argparse.Namespace, settings: ServerSettings) -> list[str]:
    refusals = fastdeploy_refusals(args)
    if split := tensor_parallel_refusal(args.model, args.tensor_parallel_size):
        refusals.append(split)
    if args.enable_role_switch and settings.data_parallel_size > 1:
        refusals.append("--enable-role-switch with --data-parallel-size above 1 is not served (the router sees each "
                        "rank of a PD server as its own instance; a role is the server's)")
    if settings.collect_detailed_traces is not None and not settings.otlp_traces_endpoint:
        refusals.append("--collect-detailed-traces needs --otlp-traces-endpoint (where the spans go)")
    return refusals


def _open_door(args: argparse.Namespace, settings: ServerSettings) -> Door:
    """Bind the ports before the engine loads for seconds: a port picked free by whoever started us cannot be
    taken meanwhile by a bind to port 0 of our own children (the cache service's listener could get the HTTP
    port), and a port in use fails at once, not after the model has loaded."""
    slo, rate_limits = admission_from_flags(settings.ttft_slo_ms, settings.tpot_slo_ms, settings.rate_limit)
    host = settings.host
    http_socket = listening_socket(host, settings.port)
    http_socket.set_inheritable(False)
    metrics_port = settings.metrics_port or free_port(host)
    metrics_reservation = listening_socket(host, metrics_port)  # prometheus binds its own; held until then
    advertise = advertised_host(host, settings.advertise_host)
    config = engine_config_from_args(args, pd_host=host, advertise_host=advertise)
    if slo.enabled:  # admission judges from the first request: measured before ready
        config = dataclasses.replace(config, calibrate_load=True)
    if settings.router and config.kv_events_config is None:  # the routers index what it caches
        config = dataclasses.replace(config, kv_events_config=on_free_ports(host))
    return Door(settings, config, http_socket, metrics_port, metrics_reservation, advertise,
                settings.served_model_name or model_name(args.model), resolve_model_folder(args.model), slo,
                rate_limits)


def _server_state(door: Door, engine: AsyncEngine | DataParallelEngine, tracing: InstanceTracing | None
                  ) -> ServerState:
    settings, config, ready = door.settings, door.config, engine.ready
    tokenizer = Tokenizer(door.folder)
    release_freed_memory()  # what parsing tokenizer.json left in the heap
    state = ServerState(engine, tokenizer, door.name, ready.max_model_len, settings.max_concurrency, ServerMetrics(),
                        api_key=settings.api_key,
                        sampling_defaults=load_sampling_defaults(settings.generation_config, door.folder),
                        tool_call_parser=settings.tool_call_parser, data_parallel_size=settings.data_parallel_size,
                        scheduling_policy=config.scheduling_policy)
    state.kv_pull, state.role, state.tracing = config.enable_kv_pull, ready.role, tracing
    state.prompt_work = PromptWork(ready.block_size, ready.num_blocks, config.enable_prefix_caching)
    if config.enable_lora:
        state.lora = LoRAServing.of(config.lora_modules, config.enable_lora_runtime_loading)
    if door.slo.enabled or door.rate_limits is not None:
        state.admission = ServerAdmission(door.slo, door.rate_limits,
                                          AdmissionMetrics(state.metrics.registry, "pdserve"), settings.api_key,
                                          state.taken)
    if settings.router:
        state.router_urls = settings.router
        state.instances = registrations(engine, f"http://{door.advertise}:{settings.port}", door.advertise,
                                        door.metrics_port, door.name, config.tensor_parallel_size)
        state.announce_loras()
    if config.enable_role_switch:
        state.role_changer = RoleChanger(ready.role, engine, state.metrics, lambda: state.in_flight,
                                         state.instances, state.router_urls)
    return state


def instance_tracing(settings: ServerSettings) -> InstanceTracing | None:
    if not settings.otlp_traces_endpoint:
        return None
    from pdserve.tracing.setup import start_tracing

    address = advertised_host(settings.host, settings.advertise_host)
    # One service name whatever the role (it may change in place); each span names its request's part.
    tracing = start_tracing(settings.otlp_traces_endpoint, "pdserve-instance", f"{address}:{settings.port}")
    from pdserve.api.tracing import InstanceTracing  # after: without the SDK, start_tracing says what to install

    return InstanceTracing(tracing, address, settings.port, settings.collect_detailed_traces is not None)


def start_engines(config: EngineConfig, name: str, ranks: int, pd_ports: list[int]) -> AsyncEngine | DataParallelEngine:
    """One engine, or `ranks` data-parallel ones started side by side, each on its share of this process's
    cores, rank r with the r-th --pd-comm-port (a free one past the list) and its own startup log."""
    if ranks == 1:
        return AsyncEngine(EngineClient(config, name))
    memory = config.kv_cache_memory or (None if gpu_present() else free_host_memory())  # CPU: shared by the ranks
    events = config.kv_events_config
    configs = [dataclasses.replace(config, pd_comm_port=pd_ports[r] if r < len(pd_ports) else None,
                                   data_parallel_rank=r, kv_events_config=events and events.for_rank(r),
                                   kv_cache_memory=memory // ranks if memory else None,
                                   startup_log=f"{config.startup_log}.dp{r}" if config.startup_log and r else
                                   config.startup_log) for r in range(ranks)]
    gpus, per_rank = visible_gpus(), config.tensor_parallel_size

    def start(rank_config: EngineConfig, rank: int) -> EngineClient:
        """Starts rank `rank`'s engine process (from this thread) without waiting for it to be ready."""
        mine = gpus[rank * per_rank:(rank + 1) * per_rank] if len(gpus) >= ranks * per_rank else []
        return EngineClient(rank_config, name, core_share(my_cores(), rank, ranks) or None,
                            {"CUDA_VISIBLE_DEVICES": ",".join(mine)} if mine else None, wait=False)

    clients = [start(c, r) for r, c in enumerate(configs)]  # side by side; each waited for below
    try:
        for client in clients:
            client.wait_ready()
    except BaseException:
        for client in clients:
            client.close(ask=False)
        raise
    return DataParallelEngine([EngineRank(r, pinned(c, client.ready), AsyncEngine(client))
                               for r, (c, client) in enumerate(zip(configs, clients, strict=True))], start)


def pinned(config: EngineConfig, ready: EngineReady) -> EngineConfig:
    """A rank's config with the ports it bound: restarted in place, it binds them again, so what the server
    registered (its control-plane port, its KV event endpoints) stays true."""
    events = config.kv_events_config
    if events is not None and ready.kv_events:
        events = msgspec.structs.replace(events, endpoint=ready.kv_events, replay_endpoint=ready.kv_events_replay)
    return dataclasses.replace(config, pd_comm_port=ready.pd_comm_port or config.pd_comm_port,
                               kv_events_config=events)


def registrations(engine: AsyncEngine | DataParallelEngine, url: str, advertise: str, metrics_port: int, name: str,
                  tp_size: int) -> list[dict]:
    """What this server registers with the router: itself, or in PD roles each data-parallel rank as its own
    endpoint (`/dp/R`, its own control-plane port), since the router pairs ranks, not servers."""
    clients = [(f"{url}/dp/{rank}" if engine.data_parallel else url, c) for rank, c in engine.rank_clients()]
    if clients[0][1].ready.role == Role.MIXED:  # the server balances its ranks itself: the router sees their union
        return [_registration(url, clients[0][1].ready, [c.ready for _, c in clients], advertise, metrics_port, name,
                              tp_size)]
    return [_registration(u, c.ready, [c.ready], advertise, metrics_port, name, tp_size) for u, c in clients]


def _registration(url: str, ready: EngineReady, engines: list[EngineReady], advertise: str, metrics_port: int,
                  name: str, tp_size: int) -> dict:
    sources = [KVEventSource(endpoint=advertised_endpoint(e.kv_events, advertise),
                             replay=e.kv_events_replay and advertised_endpoint(e.kv_events_replay, advertise),
                             pull=f"{advertise}:{e.kv_pull_port}" if e.kv_pull_port else None)
               for e in engines if e.kv_events]
    return Registration(role=ready.role, url=url, host=advertise, host_id=host_id(), pid=os.getpid(),
                        metrics_port=metrics_port, model=name,
                        pd_comm=f"{advertise}:{ready.pd_comm_port}" if ready.pd_comm_port else None,
                        transports=ready.transports, tp_size=tp_size, block_size=ready.block_size,
                        compatibility_key=ready.compatibility_key, kv_events=sources,
                        pd_sides=ready.pd_sides).model_dump()


def advertised_endpoint(bound: str, advertise: str) -> str:
    """A ZMQ address as peers reach it: the bound tcp port on the advertised host (ipc:// as it is)."""
    if not bound.startswith("tcp://"):
        return bound
    return f"tcp://{advertise}:{bound.rpartition(':')[2]}"


def _announcement(host: str, port: int, metrics_port: int, name: str, role: str, pd_comm_port: int | None,
                  data_parallel_size: int = 1) -> str:
    pd = f", pd-comm-port {pd_comm_port}" if pd_comm_port else ""
    pd += f", {data_parallel_size} data-parallel ranks" if data_parallel_size > 1 else ""
    example = DEMO_REQUEST
    return (f"pdserve: serving {name} on http://{host}:{port} (OpenAI API under /v1, metrics on port {metrics_port}, "
            f"role {role}{pd})\n  curl http://{host}:{port}/v1/chat/completions "
            f"-H 'Content-Type: application/json' -d '{example}'")
