"""A deployment as data, the same for a local launch and one on Ray: which instances and routers, their names,
hosts, ports and flags."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from pdserve.api.serve import free_port
from pdserve.config.flags import to_flags
from pdserve.config.roles import Role
from pdserve.deploy.settings import (
    LaunchSettings,
    instance_flag,
    role_counts,
    tensor_parallel_sizes,
)
from pdserve.router.settings import RouterSettings
from pdserve.utils.dtype_names import gpu_present
from pdserve.utils.shm_room import free_host_memory


@dataclass(frozen=True)
class InstanceSpec:
    name: str
    role: Role
    host: str
    port: int
    metrics_port: int
    pd_comm_port: int | None  # prefill and decode: fixed, so a restarted instance comes back where it was
    host_id: str | None = None  # None: the machine's own
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    @property
    def endpoints(self) -> int:
        """What it registers with the router: each data-parallel rank in PD roles, itself when mixed."""
        return self.data_parallel_size if self.role != Role.MIXED else 1

    @property
    def cores_wanted(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    def command(self, router_url: str, extra: list[str]) -> list[str]:
        host_id = ["--host-id", self.host_id] if self.host_id else []
        pd_port = ["--pd-comm-port", str(self.pd_comm_port)] if self.pd_comm_port else []
        return [sys.executable, "-m", "pdserve.cli", "serve", "--splitwise-role", self.role, "--host", self.host,
                "--port", str(self.port), "--metrics-port", str(self.metrics_port), *pd_port,
                "--router", router_url, *host_id, *extra, "--tensor-parallel-size", str(self.tensor_parallel_size)]


@dataclass(frozen=True)
class RouterSpec:
    name: str
    own_port: int | None  # None: the only router, on --port alone

    def command(self, settings: RouterSettings) -> list[str]:
        if self.own_port is not None:
            settings = dataclasses.replace(settings, reuse_port=True, own_port=self.own_port)
        return [sys.executable, "-m", "pdserve.cli", "router", *to_flags(settings)]


def plan_routers(host: str, n: int) -> list[RouterSpec]:
    if n < 1:
        raise ValueError("--routers must be at least 1")
    if n == 1:
        return [RouterSpec("router", None)]
    return [RouterSpec(f"router-{i}", free_port(host)) for i in range(n)]


def registration_urls(host: str, port: int, routers: list[RouterSpec]) -> list[str]:
    """Where instances register: every router's own port (the shared one reaches only one of them)."""
    return [f"http://{host}:{r.own_port if r.own_port is not None else port}" for r in routers]


def instance_hosts(router_host: str, n: int) -> list[str]:
    """Loopback: 127.0.0.2, 127.0.0.3, ... (one address per instance, as on separate hosts); else the router's."""
    if router_host in ("127.0.0.1", "localhost") and n <= 250:
        return [f"127.0.0.{2 + i}" for i in range(n)]
    return [router_host] * n


def instance_names(launch: LaunchSettings) -> list[tuple[Role, str]]:
    """(role, name) of every instance, in start order; a deployment that cannot serve is refused."""
    counts = role_counts(launch)
    if (counts[Role.PREFILL] > 0) != (counts[Role.DECODE] > 0):
        raise ValueError("a PD deployment needs at least one --prefill and one --decode instance (or neither)")
    if not sum(counts.values()):
        raise ValueError("nothing to launch: give --prefill/--decode and/or --mixed")
    return [(role, f"{role}-{i}") for role, count in counts.items() for i in range(count)]


def plan(launch: LaunchSettings, instance_args: list[str] = ()) -> list[InstanceSpec]:
    names = instance_names(launch)
    hosts = instance_hosts(launch.host, len(names))
    tp = tensor_parallel_sizes(launch, list(instance_args))
    dp = instance_flag(list(instance_args), ("--data-parallel-size", "-dp"), 1)
    return [InstanceSpec(name, role, host, free_port(host), free_port(host),
                         free_port(host) if role != Role.MIXED else None,
                         f"launch-{host}" if launch.separate_hosts else None, tp[role], dp)
            for (role, name), host in zip(names, hosts, strict=True)]


def cpu_only() -> bool:
    """Checked without importing torch, which would cost this supervising process ~200 MB for the
    deployment's whole life."""
    return not gpu_present()


SIZING_FLAGS = ("--kv-cache-memory", "--num-gpu-blocks-override")


def needs_memory_share(instance_args: list[str] | tuple[str, ...]) -> bool:
    """On CPU, with no flag that sizes the KV cache, instances started together must split the free RAM."""
    return cpu_only() and not any(a.split("=")[0] in SIZING_FLAGS for a in instance_args)


def memory_shares(instance_args: list[str], n: int) -> list[str]:
    """On CPU, where no flag sizes the caches, each of the n instances gets an equal share of the free
    RAM as its --kv-cache-memory: started together, each would size from all of it, and together
    they could fill more than there is (an instance then dies of SIGBUS or the OOM killer)."""
    if not needs_memory_share(instance_args):
        return []
    return ["--kv-cache-memory", str(free_host_memory() // n)]
