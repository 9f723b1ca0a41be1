"""Routing on what engines cache, end to end: `pdserve launch` with two routers on one port, mixed instances
beside a prefill/decode pair, and every engine publishing KV events. A conversation's turns, sent to one
router and then the other, all reach the instance(s) holding its prefix: a mixed instance for one, the
same P and the same D for another (D then gets only the blocks it lacks). Without events each router
would know only its own half of the turns (see the tie-breaks the turn order below sets up). When the
holder is killed, the next turns go together to a new one."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import psutil
import pytest
import torch

from tests.servers import metrics, wait_for
from tests.test_launch import Launch

pytestmark = pytest.mark.e2e
BS = 16


def _served(port: str) -> dict[str, int]:
    return {i["url"]: i["served"] for i in httpx.get(f"http://127.0.0.1:{port}/registered", timeout=5).json()
            ["instances"]}


class Conversations:
    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.routers = launch.own_ports()
        self.g = torch.Generator().manual_seed(3)

    def tokens(self, n: int) -> list[int]:
        return torch.randint(100, 49152, (n,), generator=self.g).tolist()

    def served(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for port in self.routers:
            for url, n in _served(port).items():
                total[url] = total.get(url, 0) + n
        return total

    def turn(self, router: int, prompt: list[int]) -> tuple[frozenset[str], int]:
        """Send a turn through router `router`: (the urls it went to, the cached prompt tokens reported)."""
        before = self.served()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.routers[router]}/v1", api_key="x", timeout=60,
                               max_retries=0)
        r = client.completions.create(model="model", prompt=prompt, max_tokens=4, temperature=0)
        after = self.served()
        return frozenset(u for u in after if after[u] > before.get(u, 0)), r.usage.prompt_tokens_details.cached_tokens

    def router_metric(self, name: str) -> float:
        return sum(metrics(int(port)).get(name, 0.0) for port in self.routers)


def test_turns_follow_their_prefix_across_routers_and_instances(tiny, tmp_path: Path) -> None:
    folder = tiny[0]
    launch = Launch(tmp_path, "--prefill", "1", "--decode", "2", "--mixed", "2", "--routers", "2", "--pd-policy",
                    "always", "--prefill-policy", "cache_aware", "--decode-policy", "cache_aware", "--model",
                    str(folder), "--dtype", "float32", "--block-size", str(BS), "--num-gpu-blocks-override", "200",
                    "--max-model-len", "512")
    try:
        chat = Conversations(launch)
        wait_for(lambda: all(len(_served(p)) == 5 for p in chat.routers), 30, "a router lacks instances")
        instances = launch.instances()
        role = {i["url"]: name.rsplit("-", 1)[0] for name, i in instances.items()}
        # Each router breaks a tie between instances holding nothing alike by fewest served: an unrelated turn on
        # router 0 makes it send A's first turn to a mixed instance, while router 1 would send it to the prefill.
        chat.turn(0, chat.tokens(40))
        a, b = [chat.tokens(100)], [chat.tokens(100)]
        routes = {"a": [chat.turn(0, a[0])], "b": [chat.turn(1, b[0])]}
        for router in (1, 0):
            for name, turns in (("a", a), ("b", b)):
                turns.append(turns[-1] + chat.tokens(20))
                routes[name].append(chat.turn(router if name == "a" else 1 - router, turns[-1]))
        a_urls, b_urls = {r[0] for r in routes["a"]}, {r[0] for r in routes["b"]}
        assert len(a_urls) == 1 and len(b_urls) == 1, routes
        (a_route,), (b_route,) = a_urls, b_urls
        assert [role[u] for u in a_route] == ["mixed"], routes
        assert sorted(role[u] for u in b_route) == ["decode", "prefill"], routes
        # every later turn of A found the earlier turn's whole blocks cached, as cache_aware predicted
        assert [cached for _, cached in routes["a"]] == [0, 96, 112], routes
        wait_for(lambda: chat.router_metric('pdserve_router_cached_prompt_tokens_total{source="predicted"}')
                 == chat.router_metric('pdserve_router_cached_prompt_tokens_total{source="reported"}') > 0, 5,
                 "cache_aware's predictions and the engines' reports differ")
        (d_url,) = [u for u in b_route if role[u] == "decode"]
        d = next(i for i in instances.values() if i["url"] == d_url)
        wait_for(lambda: metrics(d["metrics_port"], d["host"]).get("pdserve_kv_blocks_skipped_total", 0) >= 6 + 7, 5,
                 "P sent D blocks D already held")

        # The holder of A dies; launch restarts it empty. The next turns go together to another holder.
        psutil.Process(next(i for i in instances.values() if i["url"] in a_route)["pid"]).kill()
        (killed,) = a_route
        wait_for(lambda: all(_restarted(p, killed) for p in chat.routers), 90, "the killed instance did not rejoin")
        a.append(a[-1] + chat.tokens(20))
        first = chat.turn(0, a[-1])
        a.append(a[-1] + chat.tokens(20))
        second = chat.turn(1, a[-1])
        assert first[0] == second[0], (first, second)
        assert chat.router_metric("pdserve_router_kv_event_batches_total") > 0
    finally:
        launch.kill()


def _restarted(port: str, url: str) -> bool:
    found = httpx.get(f"http://127.0.0.1:{port}/registered", timeout=5).json()["instances"]
    return any(i["url"] == url and i["healthy"] and i["restarts"] == 1 for i in found)
