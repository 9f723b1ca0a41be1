"""Parallelism through the servers. Tensor parallel: `pdserve serve -tp 2` answers as transformers does (fp32
greedy), keeps what apps send working, and a dead rank takes the instance down cleanly; a prefill and a decode
instance of different TP sizes exchange the KV cache (both keep the instance's whole layout, each rank viewing its
heads). Data parallel: `-dp 2` spreads requests over two engines and answers the same; a rank whose worker dies
comes back while the other serves; in PD roles each rank is an endpoint the router pairs.

The embedded model's 9 heads and 3 KV heads split only at TP=3, so these run a tiny random llama with the
embedded model's tokenizer (4 heads, 2 KV heads). Prompts are token ids chosen so that transformers' top two
logits stay more than MIN_MARGIN apart at every generated position: a difference is then a bug, not a tie.
"""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.servers import Server, metrics, segments, wait_for
from tests.test_launch import Launch
from tests.tiny_models import NUM_PROMPTS, greedy_completions, greedy_texts

pytestmark = pytest.mark.e2e

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
                   "disable_by_batch_size": 16})


def test_tp2_serves_transformers_greedy_with_app_features_and_a_dead_rank_ends_it(tiny, tmp_path: Path) -> None:
    folder, prompts, answers = tiny
    before = segments()
    server = Server(tmp_path, "--model", str(folder), "--dtype", "float32", "-tp", "2", "--num-gpu-blocks-override",
                    "128", "--speculative-config", SPEC)
    try:
        ranks = server.children("pdserve.worker")
        assert len(ranks) == 2
        if len(os.sched_getaffinity(0)) == 2:  # each rank on a core of its own
            assert sorted(r.cpu_affinity() for r in ranks) == [[0], [1]]
        expected = greedy_texts(folder, answers)
        assert greedy_completions(server.url, prompts) == expected
        wait_for(lambda: metrics(server.metrics_port)["pdserve_spec_decode_num_draft_tokens_total"] > 0, 5,
                 "no proposal was verified across the ranks")  # metrics refresh each second

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60)
        choice = client.completions.create(model="model", prompt=prompts[0], max_tokens=8, temperature=0,
                                           extra_body={"structured_outputs": {"choice": ["north", "south"]}})
        assert choice.choices[0].text in ("north", "south")
        scored = client.completions.create(model="model", prompt=prompts[1], max_tokens=1, temperature=0, echo=True,
                                           logprobs=1)
        hf_prompt_logprobs = _hf_prompt_logprobs(folder, prompts[1])
        ours = scored.choices[0].logprobs.token_logprobs[1:len(prompts[1])]
        torch.testing.assert_close(torch.tensor(ours), hf_prompt_logprobs, atol=1e-3, rtol=0)

        assert httpx.post(f"{server.url}/clear_load_weight", timeout=60).status_code == 200
        assert httpx.post(f"{server.url}/update_model_weight", timeout=120).status_code == 200
        assert greedy_completions(server.url, prompts[:2]) == expected[:2]

        (rank1,) = [r for r in ranks if "--rank 1" in " ".join(r.cmdline())]
        rank1.send_signal(signal.SIGKILL)
        server.proc.wait(60)
        assert server.proc.returncode == 1, server.log()
        assert "worker rank 1 process exited" in server.log()
        server.wait_gone(20)
    finally:
        if server.proc.poll() is None:
            server.stop()
    assert segments() <= before


def _hf_prompt_logprobs(folder: Path, prompt: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)


@pytest.mark.parametrize("prefill_tp,decode_tp,transport,cache", [
    ("1", "2", "tcp", "shared, decode buffer"),  # D's ranks take what P wrote into D's host buffer
    ("2", "1", "ipc", "device"),  # each rank's own cache, copied through its view of the host staging
])  # P(TP=2) with a shared cache -> D(TP=1) over tcp: test_a_dead_decode_frees_the_blocks_of_a_tp2_prefill
def test_prefill_and_decode_of_different_tp_sizes_answer_as_transformers(
        tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefill_tp: str, decode_tp: str, transport: str,
        cache: str) -> None:
    folder, prompts, answers = tiny
    before = segments()
    extra = ["--separate-hosts"] if transport == "tcp" else []
    if "buffer" in cache:
        extra += ["--splitwise-cache-buffer-size", "0.02"]
    if cache == "device":
        monkeypatch.setenv("PDSERVE_PRIVATE_KV_CACHE", "1")
    launch = Launch(tmp_path, "--prefill", "1", "--decode", "1", "--routers", "1", "--pd-policy", "always",
                    "--prefill-tensor-parallel-size", prefill_tp, "--decode-tensor-parallel-size", decode_tp, *extra,
                    "--model", str(folder), "--dtype", "float32", "--num-gpu-blocks-override", "128")
    try:
        assert greedy_completions(launch.url, prompts) == greedy_texts(folder, answers)
        prefill = next(i for name, i in launch.instances().items() if name.startswith("prefill"))
        key = f'pdserve_kv_transfers_by_protocol_total{{dp_rank="0",protocol="{transport}"}}'
        wait_for(lambda: metrics(prefill["metrics_port"], prefill["host"]).get(key, 0) >= NUM_PROMPTS, 10,
                 f"the prefill instance did not report {NUM_PROMPTS} transfers over {transport}")
    finally:
        _stop(launch, before)


def _stop(launch: Launch, segments_before: set[str]) -> None:
    """Ctrl-C, as a user stops a deployment: everything exits and leaves no segment behind."""
    if launch.proc.poll() is None:
        launch.proc.send_signal(signal.SIGINT)
        try:
            launch.proc.wait(60)
        except Exception:
            launch.kill()
            raise
    wait_for(lambda: segments() <= segments_before, 20, "the deployment left shared-memory segments")


def test_a_dead_decode_frees_the_blocks_of_a_tp2_prefill(tiny, tmp_path: Path) -> None:
    """P (TP=2, its cache shared by its ranks) answers through D (TP=1) over tcp as transformers does; then it has
    handed a long prompt to both ranks when D dies: the transfer fails, and every block P held for it comes back
    (one block manager for all ranks)."""
    from tests.servers import Router

    folder, prompts, answers = tiny
    before = segments()
    router = Router(tmp_path / "router")
    flags = ["--model", str(folder), "--dtype", "float32", "--cache-transfer-protocol", "tcp", "--router", router.url,
             "--pd-transfer-timeout", "4", "--max-model-len", "512"]
    p = Server(tmp_path / "p", "--splitwise-role", "prefill", "-tp", "2", "--num-gpu-blocks-override", "100", *flags)
    d = Server(tmp_path / "d", "--splitwise-role", "decode", "--num-gpu-blocks-override", "100", *flags)
    ranks = p.children("pdserve.worker")
    try:
        router.wait_pairs(2)
        assert greedy_completions(router.url, prompts) == greedy_texts(folder, answers)
        wait_for(lambda: metrics(p.metrics_port)["pdserve_kv_cache_free_blocks"] == 100, 10, "P kept blocks")
        for rank in ranks:
            rank.suspend()
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{router.url}/v1/completions", timeout=60,
                                 json={"prompt": list(range(1000, 1440)), "max_tokens": 8, "temperature": 0})
            wait_for(lambda: metrics(d.metrics_port)["pdserve_num_requests_preallocated"] >= 1, 20,
                     "D did not preallocate")
            d.kill()
            for rank in ranks:
                rank.resume()
            r = answer.result(60)
        assert r.status_code != 200 or "error" in r.text
        d.wait_gone()
        wait_for(lambda: metrics(p.metrics_port)["pdserve_kv_cache_free_blocks"] == 100, 30,
                 "P did not free its blocks after D died")
        ok = httpx.post(f"{p.url}/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        for rank in ranks:
            if rank.is_running():
                rank.resume()
        for s in (p, router):
            s.stop()
        if d.proc.poll() is None:
            d.stop()
    assert segments() <= before


def test_a_rank_holds_only_its_share_of_the_weights(tmp_path: Path) -> None:
    """The embedded model (9 heads, 3 KV heads: TP=3) in fp32: each rank's resident set grows by at most 0.65x
    of what one worker's did while loading (its third of every split weight plus the replicated embedding, read
    from the file a slice at a time, never whole)."""
    grown = {}
    for tp in ("1", "3"):
        log = tmp_path / f"startup-{tp}.jsonl"
        server = Server(tmp_path / tp, "--dtype", "float32", "--quantization", "none", "-tp", tp,
                        "--num-gpu-blocks-override", "32",
                        "--max-model-len", "512", "--startup-log", str(log))
        try:
            (loaded,) = [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "loaded"]
            grown[tp] = loaded["weights_resident"]
        finally:
            server.stop()
    (whole,) = grown["1"]
    assert whole > 400 << 20, grown  # fp32: 540 MB of weights
    # measured 0.58-0.60 of the whole (its share + the replicated embedding + the process's own growth)
    assert len(grown["3"]) == 3 and max(grown["3"]) <= 0.65 * whole, grown
    print(f"weights resident: TP=1 {whole / 2**20:.0f} MiB; TP=3 ranks {[round(g / 2**20) for g in grown['3']]} MiB")


def test_dp2_spreads_requests_answers_the_same_and_heals_a_dead_rank(tiny, tmp_path: Path) -> None:
    folder, prompts, answers = tiny
    before = segments()
    server = Server(tmp_path, "--model", str(folder), "--dtype", "float32", "-dp", "2", "--num-gpu-blocks-override",
                    "128")
    try:
        expected = greedy_texts(folder, answers)
        assert greedy_completions(server.url, prompts) == expected
        served = 'pdserve_data_parallel_requests_total{{dp_rank="{}"}}'
        wait_for(lambda: all(metrics(server.metrics_port).get(served.format(r), 0) > 0 for r in (0, 1)), 5,
                 "requests did not land on both ranks")
        engines = server.children("pdserve.instance.engine_process")
        assert len(engines) == 2
        if len(os.sched_getaffinity(0)) == 2:  # each rank's engine (and its worker) on a core of its own
            assert sorted(e.cpu_affinity() for e in engines) == [[0], [1]]
        # rank 1 is asked by name (/dp/1/...), as a router addresses a rank's PD endpoint
        assert greedy_completions(f"{server.url}/dp/1", prompts[:2]) == expected[:2]

        (worker,) = [w for w in server.children("pdserve.worker") if w.parent().pid == engines[1].pid]
        worker.kill()
        wait_for(lambda: httpx.get(f"{server.url}/dp/1/health", timeout=5).status_code == 503, 15,
                 "the dead rank still says it is healthy")
        assert greedy_completions(server.url, prompts[:4]) == expected[:4]  # the other rank serves meanwhile
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        wait_for(lambda: httpx.get(f"{server.url}/dp/1/health", timeout=5).status_code == 200, 60,
                 "the dead rank did not come back")
        assert greedy_completions(f"{server.url}/dp/1", prompts[:2]) == expected[:2]
        assert server.proc.poll() is None
        assert metrics(server.metrics_port)['pdserve_data_parallel_restarts_total{dp_rank="1"}'] == 1
    finally:
        server.stop()
    assert segments() <= before


def test_each_data_parallel_rank_is_a_pd_endpoint_the_router_pairs(tiny, tmp_path: Path) -> None:
    folder, prompts, answers = tiny
    before = segments()
    launch = Launch(tmp_path, "--prefill", "1", "--decode", "1", "--routers", "1", "--pd-policy", "always",
                    "--model", str(folder), "--dtype", "float32", "--num-gpu-blocks-override", "128",
                    "--data-parallel-size", "2")
    try:
        endpoints = launch.instances()
        assert sorted(endpoints) == ["decode-0", "decode-1", "prefill-0", "prefill-1"], endpoints
        assert {e["url"].rsplit("/dp/", 1)[1] for e in endpoints.values()} == {"0", "1"}
        prefill_ports = {e["pd_comm"] for name, e in endpoints.items() if name.startswith("prefill")}
        assert len(prefill_ports) == 2 and None not in prefill_ports  # each P rank its own control plane
        assert greedy_completions(launch.url, prompts) == greedy_texts(folder, answers)
        served = [i["served"] for i in httpx.get(f"{launch.url}/registered", timeout=5).json()["instances"]]
        assert all(n > 0 for n in served), served
    finally:
        _stop(launch, before)


def test_a_rank_killed_during_startup_fails_the_start_with_a_message(tiny, tmp_path: Path) -> None:
    folder = tiny[0]
    before = segments()
    server = Server(tmp_path, "--model", str(folder), "--dtype", "float32", "-tp", "2", "--num-gpu-blocks-override",
                    "64", wait=False)
    try:
        def rank_1() -> list:
            try:
                return [w for w in server.children("pdserve.worker") if "--rank 1" in " ".join(w.cmdline())]
            except Exception:  # noqa: BLE001 - a process that went away while listed
                return []

        wait_for(lambda: bool(rank_1()), 30, "rank 1 never started")
        rank_1()[0].kill()
        server.proc.wait(60)
        assert server.proc.returncode not in (0, None)
        assert "worker rank 1 process exited" in server.log(), server.log()
        server.wait_gone(20)
    finally:
        if server.proc.poll() is None:
            server.kill()
    assert segments() <= before
