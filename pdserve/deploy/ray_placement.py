"""Where `pdserve launch --ray` may put each member of a deployment, decided from what Ray says of its nodes.

Pure functions on `RayNode` (one entry of `ray.nodes()`), so the rules are tested without a cluster. A node rule
(`--prefill-nodes`, `--decode-nodes`, `--router-nodes`) is a comma-separated list of terms that must all hold:
`key=value` is a Ray node label (`ray start --labels`), a bare name a custom resource the node has
(`ray start --resources '{"NAME": 1}'`). An instance asks for its cores as CPUs (and as many GPUs on a cluster
that has any); a placement the cluster cannot satisfy is refused before anything starts, named, rather than left
pending in Ray's queue for ever.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# An instance takes this much of a custom resource its rule names: a marker, so any number fit on a node.
MARKER_SHARE = 0.001


@dataclass(frozen=True)
class RayNode:
    node_id: str
    ip: str
    cpus: float
    gpus: float
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    hostname: str = ""  # the machine's: several Ray nodes may run on one

    @classmethod
    def from_ray(cls, entry: dict[str, Any]) -> RayNode:
        resources = entry.get("Resources", {})
        return cls(entry["NodeID"], entry["NodeManagerAddress"], resources.get("CPU", 0.0),
                   resources.get("GPU", 0.0), dict(resources), dict(entry.get("Labels") or {}),
                   entry.get("NodeManagerHostname") or "")

    @property
    def machine(self) -> str:
        return self.hostname or self.ip

    @property
    def short_id(self) -> str:
        return self.node_id[:12]


def alive_nodes(entries: Iterable[dict[str, Any]]) -> list[RayNode]:
    return [RayNode.from_ray(e) for e in entries if e.get("Alive")]


def cache_memory_share(free_bytes: int, cores: float, node: RayNode, nodes: list[RayNode]) -> int:
    """The RAM an instance of `cores` CPUs on `node` may size its KV cache from, where no flag sizes it: its share,
    by CPUs, of its machine's free RAM, counting every Ray node on that machine (Ray places by CPUs, so the
    instances of one machine together never size past what it has; two Ray nodes on one host each sized from
    all of it and the second instance found no room), and no more than its share of the node's own `memory`."""
    machine_cpus = sum(n.cpus for n in nodes if n.machine == node.machine) or node.cpus
    share = free_bytes * min(1.0, cores / max(machine_cpus, 1.0))
    if (node_memory := node.resources.get("memory")) and node.cpus:
        share = min(share, node_memory * min(1.0, cores / node.cpus))
    return int(share)


@dataclass(frozen=True)
class NodeRule:
    labels: dict[str, str] = field(default_factory=dict)
    resources: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> NodeRule:
        labels, resources = {}, []
        for term in filter(None, (t.strip() for t in (text or "").split(","))):
            key, eq, value = term.partition("=")
            if eq:
                if not key or not value:
                    raise ValueError(f"node rule term {term!r}: a label is key=value")
                labels[key] = value
            else:
                resources.append(term)
        return cls(labels, tuple(resources))

    def matches(self, node: RayNode) -> bool:
        return (all(node.labels.get(k) == v for k, v in self.labels.items())
                and all(node.resources.get(r, 0.0) > 0 for r in self.resources))

    def __str__(self) -> str:
        terms = [f"{k}={v}" for k, v in self.labels.items()] + list(self.resources)
        return ",".join(terms) or "any node"


@dataclass(frozen=True)
class Demand:
    """What one instance asks of the node it lands on."""

    name: str
    cpus: int
    gpus: int
    rule: NodeRule

    def fits(self, node: RayNode) -> bool:
        return self.rule.matches(node) and node.cpus >= self.cpus and node.gpus >= self.gpus

    def actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.cpus, "num_gpus": self.gpus, "scheduling_strategy": "SPREAD"}
        if self.rule.labels:
            options["label_selector"] = dict(self.rule.labels)
        if self.rule.resources:
            options["resources"] = {r: MARKER_SHARE for r in self.rule.resources}
        return options

    def describe(self) -> str:
        gpus = f" and {self.gpus} GPUs" if self.gpus else ""
        rule = f" on a node matching {self.rule}" if self.rule.labels or self.rule.resources else ""
        return f"{self.cpus} CPUs{gpus}{rule}"


def unplaceable(demands: list[Demand], nodes: list[RayNode]) -> str | None:
    """Why these instances cannot all be placed (None: they fit, as far as whole nodes tell): an instance no
    single node can hold, or more CPUs asked of the nodes a rule allows than they have together."""
    if not nodes:
        return "the Ray cluster has no live node"
    for d in demands:
        if not any(d.fits(n) for n in nodes):
            eligible = [n for n in nodes if d.rule.matches(n)]
            if not eligible:
                return f"{d.name} asks for a node matching {d.rule}: no live node of the cluster does"
            biggest = max(eligible, key=lambda n: (n.cpus, n.gpus))
            return (f"{d.name} asks for {d.describe()}: the largest such node has {biggest.cpus:g} CPUs and "
                    f"{biggest.gpus:g} GPUs")
    by_rule: dict[str, list[Demand]] = {}
    for d in demands:
        by_rule.setdefault(str(d.rule), []).append(d)
    for group in by_rule.values():
        rule = group[0].rule
        asked = sum(d.cpus for d in group)
        have = sum(n.cpus for n in nodes if rule.matches(n))
        if asked > have:
            names = ", ".join(d.name for d in group)
            return (f"{names} ask for {asked} CPUs on nodes matching {rule}: the cluster's such nodes have "
                    f"{have:g} in all")
    return None


def router_nodes(rule: NodeRule, nodes: list[RayNode]) -> list[RayNode]:
    """The nodes that run routers: those the rule allows, each once."""
    return [n for n in nodes if rule.matches(n)]


def placement_table(rows: list[dict[str, Any]]) -> str:
    """The deployment as it stands: one line per member (from `RayMember.info`)."""
    header = ("member", "role", "node", "address", "ports", "pid", "restarts")
    lines = [header]
    for r in rows:
        ports = ",".join(f"{k}={v}" for k, v in r.get("ports", {}).items())
        lines.append((r["name"], r.get("role", "?"), r.get("node", "-"), r.get("ip", "-"), ports or "-",
                      str(r.get("pid") or "-"), str(r.get("restarts", 0))))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)
