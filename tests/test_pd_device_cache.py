"""PD with the KV cache in device memory (issue 28), on CPU: PDSERVE_PRIVATE_KV_CACHE=1 keeps every
worker's cache private, as a CUDA cache is, so every role takes the staging path: P copies each finished
layer device -> staging before the messager may send it, D copies what P wrote (staging, or the decode
buffer) host -> device before the request decodes, and the host prefix tier is copied by the worker.

1P3D through the router: D over ipc with a decode buffer, D over tcp with a host tier, D over rdma
(NIXL, when installed); P with a host tier. Greedy output equals transformers fp32 (on a tiny random llama: the
order of copies is checked, which any model shows) and a mixed instance with an ordinary shared cache; a prompt
evicted from P's cache comes back from P's host tier; every block is freed and no segment is left. Then the
ordering check: with every copy slowed down on a background thread (a test hook), output is still exact -- it would
not be if P announced a layer before its copy completed or D decoded before its copy-in completed.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from pdserve.instance.startup import PRIVATE_CACHE_ENV
from pdserve.transport import rdma_available
from pdserve.worker.kv_copier import DELAY_ENV
from tests.greedy import assert_same_greedy_completion
from tests.servers import Router, Server, metrics, segments, stop_all, wait_for

pytestmark = pytest.mark.e2e  # starts pdserve processes

NIXL = rdma_available()
# 8 blocks of 16 tokens: a 96-token prompt + 8 new tokens takes 7, so each new prompt evicts the last
SMALL = ["--num-gpu-blocks-override", "8", "--max-model-len", "128", "--max-num-batched-tokens", "128"]
COMMON = ["--pd-transfer-timeout", "10"]
PRIVATE = {PRIVATE_CACHE_ENV: "1"}
NEW_TOKENS = 8
MIN_MARGIN = 0.01  # the oracle's top two must differ by more than this at every position (no near ties)
LOGPROB_TOL = 1e-3
PARAGRAPHS = [
    "The river runs past the old mill, where the miller keeps a ledger of every sack of grain that he grinds. ",
    "A lighthouse keeper climbs two hundred steps each evening to light the lamp that guides the ships home. ",
    "In the library the oldest books are kept behind glass, and the librarian turns their pages with gloves. ",
]
SHORT = ["The capital of France is", "Water boils at a temperature of", "Monday, Tuesday,"]
DECODES = ("d_buffer", "d_tcp", *(("d_rdma",) if NIXL else ()))


@pytest.fixture(scope="module")
def tokenizer():
    from pdserve.loader import resolve_model_folder
    from pdserve.tokenization.tokenizer import Tokenizer

    return Tokenizer(resolve_model_folder(None))


def _long_prompts(tokenizer) -> list[list[int]]:  # noqa: ANN001
    return [tokenizer.encode(p * 6)[:96] for p in PARAGRAPHS]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    """(the flags that serve a tiny random llama exactly, transformers' model of it): the staging path's order
    is what is checked, which any model shows."""
    from tests.tiny_models import make_tiny_servable

    folder = tmp_path_factory.mktemp("tiny-device") / "model"
    hf = make_tiny_servable(folder, seed=2, initializer_range=0.5)  # this module's prompts have no near tie on it
    return ["--model", str(folder), "--served-model-name", "tiny", "--dtype", "float32"], hf


@pytest.fixture(scope="module")
def oracle(model, tokenizer) -> dict[tuple[int, ...], list[str]]:  # noqa: ANN001
    """transformers fp32's greedy token texts for every prompt of this module; each prompt is checked to
    have no near tie, so an exact comparison is fair."""
    out = {}
    for prompt in [*_long_prompts(tokenizer), *(tokenizer.encode(s) for s in SHORT)]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model[1].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, output_logits=True,
                                    return_dict_in_generate=True, pad_token_id=2)
        top2 = torch.cat(gen.logits).float().topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        assert margin > MIN_MARGIN, f"prompt {prompt[:8]}... has a near tie ({margin:.4f}); pick another"
        out[tuple(prompt)] = [tokenizer.token_text(t) for t in gen.sequences[0, len(prompt):].tolist()]
    return out


def _complete(url: str, prompt: list[int]) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=180)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS,
                                     temperature=0, logprobs=2, extra_body={"min_tokens": NEW_TOKENS})


def _assert_exact(out: openai.types.Completion, want: list[str], reference: openai.types.Completion | None,
                  what: str) -> None:
    assert out.choices[0].logprobs.tokens == want, f"{what}: not transformers' greedy tokens"
    if reference is not None:
        assert_same_greedy_completion(out, reference, what)
        for a, b in zip(out.choices[0].logprobs.token_logprobs, reference.choices[0].logprobs.token_logprobs,
                        strict=True):
            assert abs(a - b) < LOGPROB_TOL, f"{what}: logprob {a} vs the mixed instance's {b}"


def _all_free(s: Server) -> bool:
    m = metrics(s.port)
    return m["pdserve_kv_cache_free_blocks"] == m["pdserve_kv_cache_total_blocks"]


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, model) -> Iterator[dict]:  # noqa: ANN001
    before = segments()
    tmp = tmp_path_factory.mktemp("pd_device")
    router = Router(tmp / "router")
    reg = ["--router", router.url, *COMMON, *model[0]]
    specs = {
        "prefill": ["--splitwise-role", "prefill", "--cache-transfer-protocol", "ipc,tcp,rdma" if NIXL else "ipc,tcp",
                    *SMALL, "--swap-space", "0.1", *reg],
        "d_buffer": ["--splitwise-role", "decode", "--cache-transfer-protocol", "ipc", *SMALL,
                     "--splitwise-cache-buffer-size", "0.05", *reg],
        "d_tcp": ["--splitwise-role", "decode", "--cache-transfer-protocol", "tcp", *SMALL, "--swap-space", "0.1",
                  *reg],
        **({"d_rdma": ["--splitwise-role", "decode", "--cache-transfer-protocol", "rdma", *SMALL, *reg]}
           if NIXL else {}),
    }
    servers = {name: Server(tmp / name, *flags, wait=False, env=PRIVATE) for name, flags in specs.items()}
    servers["mixed"] = Server(tmp / "mixed", *SMALL, *COMMON, *model[0], wait=False)  # an ordinary shared-memory cache
    try:
        for s in servers.values():
            s.wait_ready(240)
        router.wait_pairs(len(DECODES) + 1)
        yield {"router": router, **servers}
        for name, s in servers.items():
            wait_for(lambda s=s: _all_free(s), 15, f"{name} did not give every block back")
    finally:
        stop_all([*servers.values(), router])
    assert segments() <= before, f"shared-memory segments left behind: {segments() - before}"


def test_every_role_takes_the_staging_path(pd: dict) -> None:
    for name in ("prefill", *DECODES):
        log = pd[name].log()
        assert "KV cache created in device memory" in log, f"{name} did not keep its cache private"
        assert ("staging pdserve-kv-" in log) == (name != "d_buffer"), f"{name}'s worker mapped no staging segment"
    assert "buffer pdserve-kv-" in pd["d_buffer"].log()  # D receives into its buffer: no staging there
    assert "host pdserve-kv-" in pd["prefill"].log() and "host pdserve-kv-" in pd["d_tcp"].log()


def test_pd_through_device_caches_equals_transformers_and_mixed(pd: dict, oracle: dict, tokenizer) -> None:  # noqa: ANN001
    prompts = [list(p) for p in oracle] * 2  # twice: each decode instance gets its share of every kind
    with ThreadPoolExecutor(4) as pool:
        pd_outs = list(pool.map(lambda p: _complete(pd["router"].url, p), prompts))
    mixed_outs = [_complete(pd["mixed"].url, p) for p in prompts]
    for i, (got, ref, prompt) in enumerate(zip(pd_outs, mixed_outs, prompts, strict=True)):
        _assert_exact(got, oracle[tuple(prompt)], ref, f"prompt {i}")
    sent = metrics(pd["prefill"].port)["pdserve_kv_transfer_bytes_sent_total"]
    got = {n: metrics(pd[n].port)["pdserve_kv_transfer_bytes_received_total"] for n in DECODES}
    assert all(v > 0 for v in got.values()), f"a transport carried nothing: {got}"
    assert sent == sum(got.values())
    assert metrics(pd["d_buffer"].port)["pdserve_kv_swap_in_bytes_total"] > 0, "the buffer was never copied in"


def test_a_prompt_evicted_from_p_comes_back_from_its_host_tier(pd: dict, oracle: dict, tokenizer) -> None:  # noqa: ANN001
    a, b, c = _long_prompts(tokenizer)
    hits = metrics(pd["prefill"].port).get("pdserve_host_cache_hit_blocks_total", 0)
    first = _complete(pd["router"].url, a)
    for other in (b, c):  # each fills P's 8-block cache: A is evicted (and saved to P's host tier)
        _complete(pd["router"].url, other)
    again = _complete(pd["router"].url, a)
    _assert_exact(again, oracle[tuple(a)], first, "the prompt served from P's host tier")
    wait_for(lambda: metrics(pd["prefill"].port)["pdserve_host_cache_hit_blocks_total"] >= hits + 5, 10,
             "P did not load the evicted prompt from its host tier")


def test_weights_cleared_and_loaded_again_remake_the_device_caches(pd: dict, oracle: dict) -> None:
    """POST /clear_load_weight frees the weights and the private cache of every PD instance; after
    /update_model_weight they make them again (the host segments stay the cache service's) and serve
    the same output."""
    instances = ("prefill", *DECODES)
    for name in instances:
        assert httpx.post(f"{pd[name].url}/clear_load_weight", timeout=60).status_code == 200
    for name in instances:
        assert httpx.post(f"{pd[name].url}/update_model_weight", timeout=300).status_code == 200
    pd["router"].wait_pairs(len(DECODES) + 1)
    prompts = [list(p) for p in oracle] * 2
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: _complete(pd["router"].url, p), prompts))
    for i, (out, prompt) in enumerate(zip(outs, prompts, strict=True)):
        _assert_exact(out, oracle[tuple(prompt)], None, f"prompt {i} after the weights came back")


def test_slowed_copies_are_waited_for_on_both_sides(tmp_path: Path, model, oracle: dict) -> None:  # noqa: ANN001
    """Every copy device <-> host takes 20 ms more on a background thread (far longer than the copy itself); P
    must still signal a layer only after its staging copy, and D decode only after its copy-in (else the KV read
    is stale: zeros here)."""
    before = segments()
    router = Router(tmp_path / "router")
    reg = ["--router", router.url, "--cache-transfer-protocol", "ipc", *COMMON, *model[0], *SMALL]
    slow = {**PRIVATE, DELAY_ENV: "0.02"}
    p = Server(tmp_path / "p", "--splitwise-role", "prefill", *reg, wait=False, env=slow)
    d = Server(tmp_path / "d", "--splitwise-role", "decode", *reg, wait=False, env=slow)
    try:
        for s in (p, d):
            s.wait_ready(240)
        router.wait_pairs(2)
        for s in (p, d):
            assert "KV copies delayed by 0.02 s" in s.log()
        prompts = [list(x) for x in oracle]
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda x: _complete(router.url, x), prompts))
        for i, (out, prompt) in enumerate(zip(outs, prompts, strict=True)):
            _assert_exact(out, oracle[tuple(prompt)], None, f"prompt {i} with slowed copies")
        for s in (p, d):
            wait_for(lambda s=s: _all_free(s), 15, f"{s} did not give every block back")
    finally:
        stop_all([p, d, router])
    assert segments() <= before, f"shared-memory segments left behind: {segments() - before}"


def test_layer_groups_go_through_staging_and_the_decode_buffer_group_by_group(tmp_path: Path, tokenizer) -> None:  # noqa: ANN001
    """A tiny Gemma 3 (a sliding layer with a 12-token window, a global layer: a block table each, 4-token blocks),
    1P2D with caches in device memory: P stages each layer's blocks of its own group, one D swaps every group's
    blocks in from its decode buffer, the other copies them in from staging. Prompts reach past the window, so the
    sliding group gets only the window's blocks; greedy equals transformers fp32. (At the default initializer range
    attention is spread over the keys, so a sliding layer's blocks sent wrong or not at all change the answer.)"""
    from tests.tiny_models import make_tiny_servable

    hf = make_tiny_servable(tmp_path / "gemma", name="gemma3", seed=1)
    g = torch.Generator().manual_seed(3)
    prompts, want = [], []
    while len(prompts) < 4:
        prompt = torch.randint(100, 49152, (int(torch.randint(30, 60, (1,), generator=g)),), generator=g).tolist()
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
        if (top2[:, 0] - top2[:, 1]).min() > MIN_MARGIN:
            prompts.append(prompt)
            want.append(out.sequences[0, len(prompt):].tolist())
    before = segments()
    router = Router(tmp_path / "router", "--pd-policy", "always")
    reg = ["--router", router.url, *COMMON, "--model", str(tmp_path / "gemma"), "--served-model-name", "tiny",
           "--dtype", "float32", "--block-size", "4", "--max-model-len", "128", "--num-gpu-blocks-override", "128"]
    specs = {"p": ["--splitwise-role", "prefill", "--cache-transfer-protocol", "ipc,tcp"],
             "d_buffer": ["--splitwise-role", "decode", "--cache-transfer-protocol", "ipc",
                          "--splitwise-cache-buffer-size", "0.001"],
             "d_tcp": ["--splitwise-role", "decode", "--cache-transfer-protocol", "tcp"]}
    servers = [Server(tmp_path / name, *flags, *reg, wait=False, env=PRIVATE) for name, flags in specs.items()]
    try:
        for s in servers:
            s.wait_ready(240)
            assert "a block table per layer group (1 layers full, 1 layers window 12)" in s.log(), s.log()[-2000:]
        router.wait_pairs(3)
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=120)
        for prompt, tokens in zip(prompts * 2, want * 2, strict=True):
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                            logprobs=1, extra_body={"min_tokens": NEW_TOKENS})
            assert out.choices[0].logprobs.tokens == [tokenizer.token_text(t) for t in tokens], "not transformers'"
        received = [metrics(s.port)["pdserve_kv_transfer_bytes_received_total"] for s in servers[1:]]
        assert all(received), f"a decode instance received nothing: {received}"
        assert metrics(servers[1].port)["pdserve_kv_swap_in_bytes_total"] > 0, "the buffer was never copied in"
        for s in servers:
            wait_for(lambda s=s: _all_free(s), 15, f"{s} did not give every block back")
    finally:
        stop_all([*servers, router])
    assert segments() <= before, f"shared-memory segments left behind: {segments() - before}"
