"""`pdserve launch --ray`: a deployment placed on a real local Ray cluster of three nodes (`ray.cluster_utils`), each
node its own host id, so prefill and decode on two nodes exchange KV over tcp as across machines. The head node
runs the router and the prefill instance; decode instances may use either other node (custom resources `router`,
`prefill`, `decode`). A removed node's instance comes back on the third one while requests keep being answered.
Placement rules are checked without a cluster where they can be."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pdserve.deploy.ray_launch import is_loopback
from pdserve.deploy.ray_placement import (
    Demand,
    NodeRule,
    RayNode,
    cache_memory_share,
    placement_table,
    unplaceable,
)
from pdserve.utils.shm_room import free_host_memory
from tests.servers import REPO, metrics, segments, wait_for
from tests.test_launch import Launch, Load
from tests.tiny_models import greedy_completions, greedy_texts


def node(cpus: float, gpus: float = 0, resources: dict | None = None, labels: dict | None = None,
         hostname: str = "") -> RayNode:
    return RayNode(f"{int(cpus)}{int(gpus)}{hostname}".ljust(56, "0"), "127.0.0.1", cpus, gpus,
                   {"CPU": cpus, "GPU": gpus, **(resources or {})}, labels or {}, hostname)


def test_node_rules_match_labels_and_custom_resources() -> None:
    rule = NodeRule.parse("zone=a, fast")
    assert rule.labels == {"zone": "a"} and rule.resources == ("fast",)
    assert rule.matches(node(4, resources={"fast": 1}, labels={"zone": "a"}))
    assert not rule.matches(node(4, resources={"fast": 1}, labels={"zone": "b"}))
    assert not rule.matches(node(4, labels={"zone": "a"}))
    assert NodeRule.parse(None).matches(node(1))
    options = Demand("decode-0", 2, 0, rule).actor_options()
    assert options["label_selector"] == {"zone": "a"} and options["resources"]["fast"] > 0
    assert options["num_cpus"] == 2 and options["scheduling_strategy"] == "SPREAD"
    with pytest.raises(ValueError, match="key=value"):
        NodeRule.parse("zone=")


def test_a_placement_the_cluster_cannot_hold_is_refused_naming_it() -> None:
    nodes = [node(2), node(4, resources={"decode": 1})]
    any_node = NodeRule()
    assert unplaceable([Demand("prefill-0", 4, 0, any_node), Demand("decode-0", 2, 0, any_node)], nodes) is None
    too_big = unplaceable([Demand("prefill-0", 8, 0, any_node)], nodes)
    assert too_big == "prefill-0 asks for 8 CPUs: the largest such node has 4 CPUs and 0 GPUs"
    no_gpu = unplaceable([Demand("decode-0", 1, 1, NodeRule.parse("decode"))], nodes)
    assert no_gpu.startswith("decode-0 asks for 1 CPUs and 1 GPUs on a node matching decode")
    together = unplaceable([Demand(f"decode-{i}", 2, 0, NodeRule.parse("decode")) for i in range(3)], nodes)
    assert together == ("decode-0, decode-1, decode-2 ask for 6 CPUs on nodes matching decode: the cluster's such "
                        "nodes have 4 in all")
    assert "no live node of the cluster does" in unplaceable([Demand("p", 1, 0, NodeRule.parse("zone=x"))], nodes)


def test_instances_on_one_machine_size_their_caches_from_its_ram_together() -> None:
    """Two Ray nodes of one machine (1 CPU each) must not each size a KV cache from all of its free RAM."""
    gib = 2**30
    a, b, elsewhere = node(1, hostname="box"), node(1, hostname="box"), node(1, hostname="other")
    assert cache_memory_share(20 * gib, 1, a, [a, b, elsewhere]) == 10 * gib
    assert cache_memory_share(20 * gib, 1, elsewhere, [a, b, elsewhere]) == 20 * gib
    assert cache_memory_share(20 * gib, 1, a, [a]) == 20 * gib  # the other node left
    small = node(2, resources={"memory": 4 * gib}, hostname="box")  # ray start --memory: what the node gives
    assert cache_memory_share(20 * gib, 1, small, [small]) == 2 * gib


def test_the_placement_table_has_a_line_per_member() -> None:
    table = placement_table([
        {"name": "router-0", "role": "router", "node": "4304ae14595f", "ip": "127.0.0.1",
         "ports": {"port": 8000, "own": 4100}, "pid": 12, "restarts": 0},
        {"name": "decode-0", "role": "decode", "node": "(placing)"}])
    lines = table.splitlines()
    assert lines[0].split() == ["member", "role", "node", "address", "ports", "pid", "restarts"]
    assert lines[1].split() == ["router-0", "router", "4304ae14595f", "127.0.0.1", "port=8000,own=4100", "12", "0"]
    assert lines[2].split() == ["decode-0", "decode", "(placing)", "-", "-", "-", "0"]


def test_a_loopback_cluster_address_keeps_the_driver_on_loopback() -> None:
    """launch --ray 127.0.0.1:PORT then connects as 127.0.0.1, where Ray would put the machine's outward address."""
    assert all(is_loopback(a) for a in ("127.0.0.1:6379", "localhost:6379", "[::1]:6379", "ray://127.0.0.1:10001",
                                        "127.0.0.1"))
    elsewhere = ("192.0.2.7:6379", "head.example:6379", "auto")  # not contacted
    assert not any(is_loopback(a) for a in elsewhere)


def test_without_ray_the_flag_says_how_to_install_it() -> None:
    hide_ray = "import sys; sys.modules['ray'] = None; from pdserve.cli import main; sys.exit(main())"
    r = subprocess.run([sys.executable, "-c", hide_ray, "launch", "--ray", "auto"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "pip install 'pdserve[ray]'" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def cluster():
    """Three Ray nodes on this machine, all on 127.0.0.1: the head (router, prefill), two for decode instances."""
    from ray.cluster_utils import Cluster

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # the head would report usage to Ray's server
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                      "resources": {"router": 1, "prefill": 1}})
    workers = [c.add_node(num_cpus=1, node_ip_address="127.0.0.1", resources={"decode": 1}) for _ in range(2)]
    try:
        yield c, workers
    finally:
        c.shutdown()


class RayLaunch(Launch):
    def __init__(self, tmp: Path, address: str, *flags: str) -> None:
        super().__init__(tmp, "--ray", address, "--router-nodes", "router", *flags)
        self.url = re.search(r"ready on (http://\S+)", self.log()).group(1)

    def by_role(self, role: str) -> list[dict]:
        return [i for i in self.instances().values() if i["role"] == role and i["healthy"]]


@pytest.mark.e2e
def test_an_unsatisfiable_placement_is_an_error_naming_it(cluster, tmp_path: Path) -> None:
    c, _ = cluster
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "launch", "--ray", c.address, "--decode-nodes",
                        "decode", "--decode-tensor-parallel-size", "3"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert ("cannot place the deployment: decode-0 asks for 3 CPUs on a node matching decode: the largest such node "
            "has 1 CPUs") in r.stderr


@pytest.mark.e2e
def test_instances_on_one_machines_ray_nodes_split_its_ram(cluster, tiny, tmp_path: Path) -> None:
    """Three Ray nodes of 1 CPU on this one machine: with no flag sizing the caches, each instance sizes its KV cache
    from a third of the free RAM, not from all of it (two nodes on one host once asked for 2 x all of it)."""
    c, _ = cluster
    folder, _, _ = tiny
    free_gib = free_host_memory() / 2**30
    launch = RayLaunch(tmp_path, c.address, "--prefill", "1", "--decode", "1", "--prefill-nodes", "prefill",
                       "--decode-nodes", "decode", "--model", str(folder), "--dtype", "float32",
                       "--gpu-memory-utilization", "0.02", "--max-model-len", "512")
    try:
        sizes = [float(x) for x in re.findall(r"profile run: device memory ([\d.]+) GiB", launch.log())]
        assert len(sizes) == 2 and all(0.2 * free_gib <= s <= 0.4 * free_gib for s in sizes), (sizes, free_gib)
        launch.proc.send_signal(signal.SIGINT)
        assert launch.proc.wait(60) == 130, launch.log()[-3000:]
    finally:
        launch.kill()


@pytest.mark.e2e
def test_ray_places_1p1d_on_two_nodes_and_heals_a_removed_node(cluster, tiny, tmp_path: Path) -> None:
    c, workers = cluster
    folder, prompts, answers = tiny
    before = segments()
    launch = RayLaunch(tmp_path, c.address, "--prefill", "1", "--decode", "1", "--prefill-nodes", "prefill",
                       "--decode-nodes", "decode", "--pd-policy", "always", "--model", str(folder), "--dtype",
                       "float32", "--num-gpu-blocks-override", "200", "--max-model-len", "512")
    try:
        (p,), (d,) = launch.by_role("prefill"), launch.by_role("decode")
        assert {n.node_ip_address for n in [c.head_node, *workers]} == {p["host"], d["host"]} == {"127.0.0.1"}
        hosts = {f"ray-{n.node_id[:12]}": n for n in [c.head_node, *workers]}
        assert p["host_id"] == f"ray-{c.head_node.node_id[:12]}" and d["host_id"] in hosts, (p, d)
        assert greedy_completions(launch.url, prompts) == greedy_texts(folder, answers)
        key = 'pdserve_kv_transfers_by_protocol_total{dp_rank="0",protocol="tcp"}'
        wait_for(lambda: metrics(p["metrics_port"], p["host"]).get(key, 0) >= len(prompts), 10,
                 "KV between the two nodes did not go over tcp")
        assert "placement at" in launch.log() and re.search(r"decode-0\s+decode\s+" + d["host_id"][4:], launch.log())

        _remove_a_node_under_load(launch, c, hosts[d["host_id"]], d)
        assert greedy_completions(launch.url, prompts[:2]) == greedy_texts(folder, answers[:2])

        pids = _pdserve_processes()
        launch.proc.send_signal(signal.SIGINT)
        assert launch.proc.wait(60) == 130, launch.log()[-3000:]
    finally:
        launch.kill()
    wait_for(lambda: not any(psutil.pid_exists(x) and psutil.Process(x).status() != psutil.STATUS_ZOMBIE
                             for x in pids), 30, "pdserve processes outlived Ctrl-C")
    wait_for(lambda: segments() <= before, 10, "KV segments were left behind")


def _pdserve_processes() -> set[int]:
    """Every pdserve process on this machine (routers, instances and theirs) but launch itself."""
    return {p.pid for p in psutil.process_iter(["cmdline"])
            if any(a.startswith("pdserve.") for a in (p.info["cmdline"] or [])[:3]) and "launch" not in
            (p.info["cmdline"] or [])}


def _remove_a_node_under_load(launch: RayLaunch, c, victim, d: dict) -> None:  # noqa: ANN001 (Ray's own types)
    """The decode instance's node leaves the cluster while two clients send requests and a long stream runs; the
    instance comes back on the third node, the stream is resumed there, and every request sent after the removal
    is answered."""
    load = Load(launch.url)
    stream_text: list[str] = []
    started = threading.Event()

    def long_stream() -> None:
        with httpx.stream("POST", f"{launch.url}/v1/completions", timeout=120, json={
                "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                started.set()
                stream_text.append(line)

    streamer = threading.Thread(target=long_stream, daemon=True)
    load.start()
    try:
        time.sleep(1)
        streamer.start()
        assert started.wait(30), "the stream did not start"
        c.remove_node(victim)
        removed_at = time.monotonic()
        wait_for(lambda: [x for x in launch.by_role("decode") if x["host_id"] != d["host_id"]], 60,
                 "the decode instance did not come back on another node")
        back_in = time.monotonic() - removed_at
        print(f"the decode instance served again {back_in:.1f} s after its node was removed")
        time.sleep(2)
    finally:
        load.stop.set()
        load.join(90)
    streamer.join(120)
    # Those sent meanwhile wait for the route (one it carried before its first token may fail: a PD error)
    failed = [(round(r[0] - removed_at, 2), r[2]) for r in load.results if r[0] > removed_at and not r[1]]
    assert not failed, failed[:3]
    assert [r for r in load.results if r[0] > removed_at + back_in], "no load after the instance came back"
    events = [json.loads(line[6:]) for line in stream_text if line.startswith("data: {")]
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 400 and "data: [DONE]" in stream_text, stream_text[-3:]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    router = metrics(int(re.search(r"own=(\d+)", launch.log()).group(1)), launch.url.split("//")[1].split(":")[0])
    assert router.get('pdserve_router_migrations_total{outcome="resumed"}', 0) >= 1, "the stream was not resumed"
