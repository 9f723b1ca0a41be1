"""`pdserve launch --ray ADDRESS`: the deployment of `pdserve launch`, placed on a Ray cluster's nodes.

Start order, as on one host: routers first (`--routers` on each router node, all on --port with SO_REUSEPORT,
pinned to their node), then every instance at once, each a Ray actor (ray_member.py) that asks for its cores
(and GPUs) and may land on any node its role's rule allows, spread across nodes. Instances register with every
router's own port. The deployment is ready when every router has every instance in its pool.

Healing: a member's actor restarts its process (launch's backoff); Ray creates an instance's actor again on
another node when its node dies (max_restarts), and it registers again; the routers resume the streams it carried
(router/migration.py) and forget its old address. A router dies with its node (it is pinned there): the load
balancer in front stops sending to that node. The placement table is printed when ready and again whenever it
changes. Ctrl-C or SIGTERM stops every member's processes, then the actors.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import sys
import time
from dataclasses import replace
from typing import Any

from pdserve.api.serve import DEMO_REQUEST
from pdserve.config.flags import from_args, to_flags
from pdserve.config.roles import Role
from pdserve.deploy.lifecycle import stop_on_signals, stopped, wait_ready
from pdserve.deploy.plan import instance_names
from pdserve.deploy.ray_member import ROUTER, MemberPlan, RayMember
from pdserve.deploy.ray_placement import (
    Demand,
    NodeRule,
    RayNode,
    alive_nodes,
    placement_table,
    router_nodes,
    unplaceable,
)
from pdserve.deploy.settings import LaunchSettings, instance_flag, own_disk_folder, tensor_parallel_sizes
from pdserve.router.settings import RouterSettings
from pdserve.utils.cluster_auth import ENV

NO_RAY = ("pdserve launch --ray needs Ray on this machine and on every node of the cluster: "
          "pip install 'pdserve[ray]' (ray==2.58.0)")
POLL_S = 2.0  # how often the placement is read back from the actors
STOP_TIMEOUT_S = 30.0


def launch_on_ray(args: argparse.Namespace, settings: LaunchSettings) -> int:
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # Ray folds alike lines of different instances into one
    try:
        import ray
    except ImportError:
        print(f"pdserve launch: {NO_RAY}", file=sys.stderr, flush=True)
        return 2
    if error := _unsupported(settings):
        print(f"pdserve launch: {error}", file=sys.stderr, flush=True)
        return 2
    address = cluster_address(settings.ray)
    node_ip = settings.ray_node_ip_address or ("127.0.0.1" if is_loopback(address) else None)
    if node_ip and is_loopback(node_ip):
        stay_on_loopback()
    try:
        ray.init(address=address, _node_ip_address=node_ip, logging_level="WARNING", log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as e:
        print(f"pdserve launch: cannot reach the Ray cluster at {settings.ray!r}: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        return _run(args, settings, RayDeployment(os.environ.get(ENV) or secrets.token_hex(16)))
    finally:
        ray.shutdown()


def cluster_address(address: str) -> str:
    """The cluster's address as Ray finds it: `auto` is $RAY_ADDRESS or the last cluster started on this
    machine (left as `auto` when there is none: ray.init then says so)."""
    if address != "auto":
        return address
    from ray._private.services import get_ray_address_from_environment

    try:
        return get_ray_address_from_environment(address, None) or address
    except ConnectionError:
        return address


def is_loopback(address: str) -> bool:
    """Whether host:port (or a bare host) names this machine's loopback interface."""
    address = address.split("://")[-1]
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
    host = host.removeprefix("[").split("]")[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def stay_on_loopback() -> None:
    """Keep Ray from swapping a loopback address for the machine's outward one: ray.init rewrites 127.0.0.1
    (the cluster's address and this node's) to the outward address unless Ray believes multi-node clusters are
    off, which is this constant (read by ray._private.services at each call). The nodes themselves keep the
    addresses they were started with."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _unsupported(settings: LaunchSettings) -> str | None:
    if settings.separate_hosts:
        return "--separate-hosts is for one machine: on Ray each node is its own host"
    if settings.cpu_binding in ("pin", "lend"):
        return (f"--cpu-binding {settings.cpu_binding} is for one machine: on Ray each instance gets its cores "
                f"as CPUs of its node and as many torch threads")
    return None


def _run(args: argparse.Namespace, settings: LaunchSettings, deployment: RayDeployment) -> int:
    import ray

    stop, stopped_by = stop_on_signals()
    try:
        nodes = alive_nodes(ray.nodes())
        plans, demands = instance_plans(settings, args.instance_args, any(n.gpus for n in nodes))
        rule = NodeRule.parse(settings.router_nodes)
        if not (routers := router_nodes(rule, nodes)):
            return _fail(f"no live node matches --router-nodes {rule}")
        if error := unplaceable(demands, nodes):
            return _fail(f"cannot place the deployment: {error}")
        admitting = len(routers) * (settings.routers or 1)
        urls = deployment.start_routers(routers, settings,
                                        replace(from_args(RouterSettings, args), admitting_routers=admitting))
        if urls is None:
            return _fail("the routers did not start (their output is above)")
        for plan, demand in zip(plans, demands, strict=True):
            deployment.start_instance(replace(plan, router_urls=tuple(urls)), demand)
        endpoints = sum(p.data_parallel_size if p.role != Role.MIXED else 1 for p in plans)
        if error := wait_ready(deployment.failure, urls, endpoints, settings.ready_timeout, stop,
                               [p.name for p in plans]):
            return _fail(error)
        if stop.is_set():
            return stopped(stopped_by)
        shown = deployment.show_placement()
        entry = ", ".join(sorted({f"http://{n.ip}:{settings.port}" for n in routers}))
        print(f"pdserve launch: ready on {entry} ({len(plans)} instances on {len(nodes)} Ray nodes, "
              f"{len(urls)} router{'s' if len(urls) > 1 else ''}); Ctrl-C stops everything", flush=True)
        print(f"  curl {entry.split(',')[0]}/v1/chat/completions -H 'Content-Type: application/json' "
              f"-d '{DEMO_REQUEST}'", flush=True)
        while not stop.wait(POLL_S):
            infos = deployment.infos()
            if crash := next((i["crash_loop"] for i in infos if i.get("crash_loop")), None):
                return _fail(crash)
            shown = deployment.show_placement(infos, shown)
        return stopped(stopped_by)
    finally:
        deployment.stop()


def _fail(message: str) -> int:
    print(f"pdserve launch: {message}", file=sys.stderr, flush=True)
    return 1


def instance_plans(settings: LaunchSettings, instance_args: list[str],
                   gpu_cluster: bool) -> tuple[list[MemberPlan], list[Demand]]:
    tp = tensor_parallel_sizes(settings, instance_args)
    dp = instance_flag(instance_args, ("--data-parallel-size", "-dp"), 1)
    rules = {Role.PREFILL: NodeRule.parse(settings.prefill_nodes), Role.DECODE: NodeRule.parse(settings.decode_nodes),
             Role.MIXED: NodeRule()}
    plans, demands = [], []
    for role, name in instance_names(settings):
        extra = own_disk_folder(instance_args, name)
        if role == Role.DECODE and settings.splitwise_cache_buffer_size:
            extra += ["--splitwise-cache-buffer-size", str(settings.splitwise_cache_buffer_size)]
        cores = tp[role] * dp
        plans.append(MemberPlan(name, role.value, cores, tuple(extra), (), tp[role], dp))
        demands.append(Demand(name, cores, cores if gpu_cluster else 0, rules[role]))
    return plans, demands


class RayDeployment:
    """The actors of one deployment, by member name."""

    def __init__(self, cluster_secret: str) -> None:
        import ray

        self.secret = cluster_secret
        self.member_class = ray.remote(RayMember)
        self.actors: dict[str, Any] = {}
        self.roles: dict[str, str] = {}

    def start_routers(self, nodes: list[RayNode], settings: LaunchSettings,
                      router_settings: RouterSettings) -> list[str] | None:
        """Routers on each node, pinned there; their own-port URLs (None: one did not start)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        flags = tuple(to_flags(router_settings))
        names = []
        for node in nodes:
            for _ in range(settings.routers or 1):
                name = f"router-{len(names)}"
                plan = MemberPlan(name, ROUTER, 0, flags, port=settings.port, bind_all=settings.host == "0.0.0.0")
                strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
                self._start(plan, num_cpus=0, scheduling_strategy=strategy, max_restarts=0)
                names.append(name)
        infos = {i["name"]: i for i in self.infos(timeout=60.0)}
        if any("url" not in infos.get(n, {}) for n in names):
            return None
        return [infos[n]["url"] for n in names]

    def start_instance(self, plan: MemberPlan, demand: Demand) -> None:
        self._start(plan, **demand.actor_options(), max_restarts=-1)

    def _start(self, plan: MemberPlan, **options: Any) -> None:
        self.actors[plan.name] = self.member_class.options(**options).remote(plan, self.secret)
        self.roles[plan.name] = plan.role

    def infos(self, timeout: float = 1.0) -> list[dict[str, Any]]:
        """Each member as its actor tells it; one being placed (or placed again) or lost, as far as known."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        refs = {name: actor.info.remote() for name, actor in self.actors.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        out = []
        for name, ref in refs.items():
            base = {"name": name, "role": self.roles[name]}
            try:
                out.append(ray.get(ref, timeout=0))
            except ActorDiedError as e:
                out.append({**base, "node": "(lost)", "lost": str(e).splitlines()[0]})
            except (ActorUnavailableError, RayActorError, ray.exceptions.GetTimeoutError):
                out.append({**base, "node": "(placing)"})
        return out

    def failure(self) -> str | None:
        """A member that failed while the deployment starts: its process exited, or its actor died."""
        for info in self.infos():
            if info.get("exit_code") is not None:
                return (f"{info['name']} exited (code {info['exit_code']}) before the deployment was ready "
                        f"(its output is above)")
            if info.get("lost"):
                return f"{info['name']} was lost: {info['lost']}"
        return None

    def show_placement(self, infos: list[dict[str, Any]] | None = None, shown: str = "") -> str:
        """Print the placement table when it differs from `shown`; the table now."""
        table = placement_table(infos if infos is not None else self.infos())
        if table != shown:
            print(f"pdserve launch: placement at {time.strftime('%H:%M:%S')}\n{table}", flush=True)
        return table

    def stop(self) -> None:
        """Every member's processes stopped by its actor, then the actors removed."""
        import ray

        refs = [actor.stop.remote() for actor in self.actors.values()]
        ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT_S)
        for actor in self.actors.values():
            ray.kill(actor)

