"""`pdserve launch`'s own settings (each field a flag, pdserve/config/flags.py), and which of the router's
settings it takes, with its own defaults for them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pdserve.config.flags import option
from pdserve.config.roles import Role


def default_routers() -> int:
    return 2 if (os.cpu_count() or 1) >= 2 else 1


@dataclass(frozen=True, kw_only=True)
class LaunchSettings:
    prefill: int | None = option(None, "prefill instances (default: 1, or 0 when --mixed is given alone)")
    decode: int | None = option(None, "decode instances (default: 1, or 0 when --mixed is given alone)")
    mixed: int = option(0, "mixed (non-disaggregated) instances; the router chooses among them and the prefill/decode "
                           "pairs by the same policy")
    host: str = option("127.0.0.1", "where the router listens")
    port: int = option(8000, "the router's port: the deployment's OpenAI endpoint")
    ready_timeout: float = option(600.0, "seconds to wait for every instance")
    routers: int | None = option(
        None, "router processes sharing --port (SO_REUSEPORT), each with its own port that instances register at: "
              "one that dies refuses no connection and cuts only its own streams (default: 2 with 2 or more cores; "
              "with --ray, per router node, default 1)")
    cpu_binding: str = option(
        "auto", "on a CPU-only machine: pin gives each instance its own cores and as many torch threads; lend (what "
                "auto does) also lets each decode instance compute on a prefill instance's cores while that one "
                "has nothing to compute (pdserve/worker/core_loan.py); none lets every instance use every core",
        choices=("auto", "lend", "pin", "none"))
    separate_hosts: bool = option(
        False, "give each instance its own host id, so prefill and decode use tcp as across machines", switch=True)
    prefill_tensor_parallel_size: int | None = option(
        None, "tensor-parallel ranks of each prefill instance (default: --tensor-parallel-size, else 1)")
    decode_tensor_parallel_size: int | None = option(
        None, "tensor-parallel ranks of each decode instance (default: --tensor-parallel-size, else 1); P and D may "
              "differ: each keeps the whole KV layout, each rank its heads")
    splitwise_cache_buffer_size: float = option(
        0.0, "GB of host buffer each decode instance receives the prefill's KV into (decode only)")
    planner: bool = option(
        False, "run the SLA planner beside the deployment: its instances may change role in place "
               "(--enable-role-switch, calibrated before ready for the planner's profile) and the planner moves them "
               "between prefill, decode and mixed as the load asks (pdserve planner --help: its flags)", switch=True)
    ray: str | None = option(
        None, "place the deployment on a Ray cluster (auto: the one `ray start` runs here; else its address): each "
              "instance a Ray actor on a node with its cores free, restarted there if its process dies and on "
              "another node if its node does; a router on every router node (pip install 'pdserve[ray]')",
        group="ray")
    ray_node_ip_address: str | None = option(
        None, "--ray: this machine's address in the cluster (default: Ray's choice, or 127.0.0.1 when the cluster's "
              "address is a loopback one: a one-machine cluster built on 127.0.0.1)", group="ray")
    prefill_nodes: str | None = option(
        None, "--ray: the nodes prefill instances may use: key=value (a node label) or NAME (a custom resource the "
              "node has); several, comma-separated, must all hold", group="ray")
    decode_nodes: str | None = option(None, "--ray: the nodes decode instances may use (as --prefill-nodes)",
                                      group="ray")
    router_nodes: str | None = option(
        None, "--ray: the nodes that each run --routers routers on --port (default: every node); point your load "
              "balancer or DNS at them", group="ray")


def instance_flag(instance_args: list[str], names: tuple[str, ...], default: int) -> int:
    """The value of an integer flag given to every instance (its last occurrence), else `default`."""
    value = default
    for i, arg in enumerate(instance_args):
        name, _, given = arg.partition("=")
        if name in names:
            value = int(given or instance_args[i + 1])
    return value


def own_disk_folder(instance_args: list[str], name: str) -> list[str]:
    """The instance arguments with `--kv-disk-path DIR` made `DIR/<name>`: each instance keeps its own disk tier
    (its index and --kv-disk-size count its own files), and finds it again when it is restarted under its name."""
    out = list(instance_args)
    for i, arg in enumerate(out):
        if arg == "--kv-disk-path" and i + 1 < len(out):
            out[i + 1] = os.path.join(out[i + 1], name)
        elif arg.startswith("--kv-disk-path="):
            out[i] = f"--kv-disk-path={os.path.join(arg.split('=', 1)[1], name)}"
    return out


def tensor_parallel_sizes(launch: Any, instance_args: list[str]) -> dict[Role, int]:
    """Each role's TP size: its own flag, else the --tensor-parallel-size (-tp) given to every instance, else 1."""
    common = instance_flag(instance_args, ("--tensor-parallel-size", "-tp"), 1)
    return {Role.PREFILL: launch.prefill_tensor_parallel_size or common,
            Role.DECODE: launch.decode_tensor_parallel_size or common, Role.MIXED: common}


def role_counts(launch: Any) -> dict[Role, int]:
    """How many instances of each role `launch` (LaunchSettings or its flags) asks for, in start order: 1P1D
    unless said otherwise, none of them when only --mixed is given."""
    pd_default = 0 if launch.mixed and launch.prefill is None and launch.decode is None else 1
    return {Role.PREFILL: pd_default if launch.prefill is None else launch.prefill,
            Role.DECODE: pd_default if launch.decode is None else launch.decode, Role.MIXED: launch.mixed}


# The router's settings (router/settings.py) that launch takes as flags and passes on to its routers, with
# what launch adds to each one's help.
ROUTER_FLAGS = {
    "prefill_policy": " (launch's default: cache_aware, on the instances' KV events)",
    "decode_policy": " (launch's default: cache_aware)",
    "pd_policy": " (launch's default: conditional, short prompts are computed on the decode instance)",
    "max_local_prefill_length": " (launch's default 512 won on ShareGPT here)",
    "max_prefill_queue_tokens": "",
    "local_prefill_decode_requests": " (launch's 4: a decode instance with few streams borrows the prefill "
                                     "instance's core and computes a long prompt faster than P alone)",
    "migration_limit": "",
    "kv_overlap_score_weight": "",
    "kv_decode_load_weight": "",
    "api_key": "",
    "ttft_slo_ms": "; the instances then time their steps before ready, so the first request is judged",
    "tpot_slo_ms": "",
    "rate_limit": "",
    "load_interval": "",
    "otlp_traces_endpoint": " (launch gives it to every instance too; --collect-detailed-traces goes to instances)",
}
# Launch's own defaults for them. The API key is not taken from $PDSERVE_API_KEY here: the routers
# read the variable themselves, which keeps the key off their command lines. Admission by SLO stays off unless
# asked for (as in vLLM and Dynamo): a batch client (an eval harness, a benchmark, a script) wants every answer,
# late or not, and bench/light_load.py measured `make demo`'s deployment refusing such loads with it on.
# Routing by cached prefix (on the KV events every launched instance publishes) halved the TTFT of later
# turns against least_tokens / least_requests on multi-turn chats (bench/kv_routing.py, docs/measurements.md).
ROUTER_DEFAULTS = {"pd_policy": "conditional", "max_local_prefill_length": 512, "local_prefill_decode_requests": 4,
                   "api_key": None, "prefill_policy": "cache_aware", "decode_policy": "cache_aware"}

# The planner's settings (planner/settings.py) that launch takes and passes on to its planner.
PLANNER_FLAGS = ("planner_interval", "planner_ttft_slo_ms", "planner_tpot_slo_ms", "planner_profile",
                 "planner_predictor", "planner_headroom", "planner_settle", "planner_drain_timeout", "planner_dry_run",
                 "planner_metrics_port")
