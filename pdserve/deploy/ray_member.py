"""One member of a `pdserve launch --ray` deployment (an instance or a router), as a Ray actor on its node.

The actor picks the member's address (its node's) and free ports there, starts the member's process tree with
launch's own `Supervisor` and keeps it running: a process that exits is restarted on the same ports with launch's
backoff, and one that crash-loops is reported (the driver then stops the deployment). The processes die with the
actor (`die_with_parent`), so a node Ray loses takes them along; Ray then creates the actor again on a node with
room (`max_restarts`), where it starts the member afresh and it registers with the routers again.

An instance's host id is its Ray node's id: instances on one node share memory (ipc), across nodes KV goes over
the network transports (tcp, rdma).
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

from pdserve.api.serve import free_port
from pdserve.config.roles import Role
from pdserve.deploy.plan import InstanceSpec, needs_memory_share
from pdserve.deploy.ray_placement import RayNode, alive_nodes, cache_memory_share
from pdserve.deploy.supervisor import Supervisor
from pdserve.utils.cluster_auth import ENV
from pdserve.utils.shm_room import free_host_memory

ROUTER = "router"
TEND_PERIOD_S = 0.5


@dataclass(frozen=True)
class MemberPlan:
    """What the driver decides for a member; the actor adds where (node, address, ports)."""

    name: str
    role: str  # prefill, decode, mixed or router
    cores: int = 1
    args: tuple[str, ...] = ()  # an instance's extra flags; a router's flags (pdserve/router/settings.py)
    router_urls: tuple[str, ...] = ()  # an instance registers with each
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    port: int = 8000  # a router's shared port
    bind_all: bool = False  # a router listens on 0.0.0.0 rather than its node's address


class RayMember:
    def __init__(self, plan: MemberPlan, cluster_secret: str) -> None:
        import ray  # this module is imported where Ray may be missing (launch without --ray)

        self.plan = plan
        self.node_id = ray.get_runtime_context().get_node_id()
        self.ip = ray.util.get_node_ip_address()
        self.ports, self.url, self.cmd = self._command()
        self.supervisor = Supervisor({ENV: cluster_secret, "OMP_NUM_THREADS": str(plan.cores)}, label_output=False)
        self.raylet = os.getppid()
        self.crash_loop: str | None = None
        self.started = threading.Event()
        self.stopping = threading.Event()
        # Every process is started from this one thread: Linux sends a child its parent-death signal when the
        # thread that forked it ends, so a short-lived thread must not be its parent.
        self.tender = threading.Thread(target=self._tend, name=f"tend-{plan.name}", daemon=True)
        self.tender.start()
        self.started.wait(30)

    def __repr__(self) -> str:  # Ray prefixes the actor's output with it
        return self.plan.name

    def _command(self) -> tuple[dict[str, int], str, list[str]]:
        plan = self.plan
        if plan.role == ROUTER:
            own = free_port(self.ip)
            host = "0.0.0.0" if plan.bind_all else self.ip
            cmd = [sys.executable, "-m", "pdserve.cli", "router", *plan.args, "--host", host,
                   "--port", str(plan.port), "--reuse-port", "--own-port", str(own)]
            return {"port": plan.port, "own": own}, f"http://{self.ip}:{own}", cmd
        role = Role(plan.role)
        spec = InstanceSpec(plan.name, role, self.ip, free_port(self.ip), free_port(self.ip),
                            free_port(self.ip) if role != Role.MIXED else None, f"ray-{self.node_id[:12]}",
                            plan.tensor_parallel_size, plan.data_parallel_size)
        ports = {"port": spec.port, "metrics": spec.metrics_port}
        if spec.pd_comm_port:
            ports["pd"] = spec.pd_comm_port
        cmd = spec.command(",".join(plan.router_urls), [*self._memory_share(), *plan.args])
        return ports, f"http://{self.ip}:{spec.port}", cmd

    def _memory_share(self) -> list[str]:
        """On a CPU node, where no flag sizes the cache, its share of the machine's free RAM (ray_placement)."""
        import ray

        if not needs_memory_share(self.plan.args):
            return []
        entries = ray.nodes()
        node = RayNode.from_ray(next(e for e in entries if e["NodeID"] == self.node_id))
        share = cache_memory_share(free_host_memory(), self.plan.cores, node, alive_nodes(entries))
        return ["--kv-cache-memory", str(share)]

    def _tend(self) -> None:
        self.supervisor.start(self.plan.name, self.cmd)
        self.started.set()
        while not self.stopping.wait(TEND_PERIOD_S):
            if os.getppid() != self.raylet:
                self._orphaned()
            if self.crash_loop is None and (message := self.supervisor.tend()):
                self.crash_loop = message
                print(f"pdserve launch: {message}", file=sys.stderr, flush=True)

    def _orphaned(self) -> None:
        """This node's raylet died (a crash; a host that dies takes us along): Ray has given the member up and
        places it again elsewhere, while this worker process may live on. It must not keep serving here."""
        print(f"pdserve launch: {self.plan.name}: the node's raylet is gone; stopping this copy",
              file=sys.stderr, flush=True)
        self.supervisor.stop()
        os._exit(1)

    def info(self) -> dict[str, Any]:
        member = self.supervisor.members.get(self.plan.name)
        proc = member.proc if member else None
        return {"name": self.plan.name, "role": self.plan.role, "node": self.node_id[:12],
                "ip": self.ip, "url": self.url, "ports": self.ports, "pid": proc.pid if proc else None,
                "exit_code": proc.poll() if proc else None, "restarts": member.restarts if member else 0,
                "crash_loop": self.crash_loop}

    def stop(self) -> bool:
        """Every process of the member ended (SIGTERM, then SIGKILL after 20 s)."""
        self.stopping.set()
        self.tender.join(5)
        self.supervisor.stop()
        return True
