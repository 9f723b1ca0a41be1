"""8-bit KV caches end to end (--kv-cache-dtype fp8 | fp8_e5m2 | int8) on the embedded model: the likelihood of a
held-out text within 2% of the full-width cache's, greedy answers that agree where the full-width cache is sure of
the next token, and PD over an 8-bit cache equal to a mixed instance with the same cache (the blocks travel as
bytes: codes and scales; on the tiny random llama). The kernels themselves: test_kv_codes.py; the disk tier:
test_kv_disk_tier.py."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pdserve.kv.layout import KVLayout
from tests.greedy import assert_same_greedy_completions, compare_greedy
from tests.servers import BLOCK, Router, Server, metrics, segments, stop_all
from tests.teacher_forced import SURE, agreement_where_sure, greedy
from tests.test_quantized import HELD_OUT, PROMPTS, _nll

pytestmark = pytest.mark.e2e  # loads the model, starts pdserve processes

KV_DTYPES = ["fp8", "fp8_e5m2", "int8"]
STEPS = 24


@pytest.fixture(scope="module")
def runners() -> Iterator[dict]:
    """ModelRunners of the exact path (fp32 weights), by KV cache dtype ("auto": fp32, the reference)."""
    from pdserve.worker.model_runner import ModelRunner

    made: dict = {}

    def get(kv: str):  # noqa: ANN202
        if kv not in made:
            made[kv] = ModelRunner(None, dtype="float32", device="cpu", quantization="none", kv_cache_dtype=kv)
        return made[kv]

    yield get
    made.clear()


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_held_out_likelihood_within_two_percent_of_the_full_width_cache(kv, runners, embedded_tokenizer):
    ids = embedded_tokenizer.encode(HELD_OUT)
    full, eight = _nll(runners("auto"), ids), _nll(runners(kv), ids)
    print(f"{kv}: NLL {eight:.4f} vs full width {full:.4f} ({eight / full - 1:+.2%})")
    assert runners(kv).kv_cache.layout.dtype == {"fp8": "fp8_e4m3"}.get(kv, kv)
    assert abs(eight / full - 1) <= 0.02


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("prompt", ["The capital of France is", "1, 2, 3, 4, 5,"])
def test_greedy_answers_equal_the_full_width_caches_until_a_near_tie(kv, prompt, runners, embedded_tokenizer):
    """Token for token until the first difference, which must come where the full-width cache's top two are less
    than a logit apart, and not before the fourth token (these prompts' first four are sure)."""
    ids = embedded_tokenizer.encode(prompt)
    want, margins = greedy(runners("auto"), ids, STEPS)
    got, _ = greedy(runners(kv), ids, STEPS)
    compare_greedy(want, got, lambda i: margins[i], SURE, f"{kv} against the full-width cache")


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_where_the_full_width_cache_is_sure_the_8bit_cache_agrees(kv, prompt, runners, embedded_tokenizer):
    """Teacher-forced on the full-width cache's greedy chat answer: the next token of each step where its top two
    are a logit or more apart."""
    ids = embedded_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
    sure = agreement_where_sure(runners("auto"), runners(kv), ids, STEPS)
    assert len(sure) >= STEPS // 4
    assert sum(sure) >= 0.9 * len(sure), f"{kv} agreed with a sure full-width cache on {sum(sure)}/{len(sure)}"


# ---- PD over an 8-bit cache ------------------------------------------------------------------------------------

COMMON = ["--kv-cache-dtype", "fp8", "--max-model-len", "1024", "--max-num-batched-tokens", "128",
          "--max-num-seqs", "16", "--num-gpu-blocks-override", "120"]


@pytest.fixture(scope="module")
def fp8_pd(tmp_path_factory: pytest.TempPathFactory, tiny_model: list[str]) -> Iterator[dict]:
    """1P1D and a mixed instance of the tiny random llama (fp32 weights, an fp8 cache): what crosses is checked,
    which any model shows."""
    before = segments()
    tmp = tmp_path_factory.mktemp("fp8_pd")
    router = Router(tmp / "router")
    reg = ["--router", router.url]
    specs = {"prefill": ["--splitwise-role", "prefill", "--cache-transfer-protocol", "ipc,tcp", *reg],
             "decode": ["--splitwise-role", "decode", "--cache-transfer-protocol", "tcp", *reg],
             "mixed": []}
    servers = {name: Server(tmp / name, *flags, *COMMON, *tiny_model, wait=False) for name, flags in specs.items()}
    try:
        for s in servers.values():
            s.wait_ready(240)
        router.wait_pairs(1)
        yield {"router": router, **servers}
    finally:
        stop_all([*servers.values(), router])
    assert segments() <= before, f"shared-memory segments left behind: {segments() - before}"


def test_pd_with_an_fp8_cache_equals_mixed_with_an_fp8_cache(fp8_pd: dict, embedded_tokenizer) -> None:
    text = HELD_OUT * 3
    ids = embedded_tokenizer.encode(text)
    prompts = ["The capital of France is", "def fibonacci(n):", "The three primary colors are", ids[:64],
               ids[5:200], ids[:300], text[:700], "Monday, Tuesday,"]

    def complete(url: str, prompt: str | list[int]) -> openai.types.Completion:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=180)
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=2)

    with ThreadPoolExecutor(len(prompts)) as pool:
        pd_outs = list(pool.map(lambda p: complete(fp8_pd["router"].url, p), prompts))
    mixed_outs = [complete(fp8_pd["mixed"].url, p) for p in prompts]
    assert_same_greedy_completions(pd_outs, mixed_outs, min_share=0.8)
    sent = metrics(fp8_pd["prefill"].port)["pdserve_kv_transfer_bytes_sent_total"]
    assert sent > 0 and sent == metrics(fp8_pd["decode"].port)["pdserve_kv_transfer_bytes_received_total"]
    # whole layers of 8-bit blocks crossed: codes and scales, 36 bytes a token and KV head where fp32 takes 128
    fp8 = KVLayout(1, 2, BLOCK, 2, 16, "fp8_e4m3")
    assert sent % fp8.layer_block_bytes == 0


COUNTING = "1, 2, 3, 4, 5,"
FALLBACK_NLL = """
import sys
sys.path.insert(0, ".")
from tests.teacher_forced import greedy
from tests.test_quantized import HELD_OUT, _nll
from pdserve.loader import resolve_model_folder
from pdserve.tokenization.tokenizer import Tokenizer
from pdserve.worker.model_runner import ModelRunner
runner = ModelRunner(None, dtype="float32", device="cpu", quantization="none", kv_cache_dtype="int8")
assert not runner.model.uses_paged_kernel
tok = Tokenizer(resolve_model_folder(None))
print("NLL", _nll(runner, tok.encode(HELD_OUT)))
print("TOKENS", *greedy(runner, tok.encode(COUNTING), 12)[0])
"""


def test_without_the_kernels_an_8bit_cache_is_written_and_read_in_torch(runners, embedded_tokenizer) -> None:
    """The path CUDA takes (gather, widen, SDPA), run on CPU with the kernels disabled: the held-out text scores
    as on the kernel path (a fresh prefill attends to its own unrounded K/V there: not bit for bit), and decode
    steps, which read the cache, give the kernel path's tokens (a counting prompt: no near tie)."""
    import os
    import subprocess
    import sys

    script = FALLBACK_NLL.replace("COUNTING", repr(COUNTING))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PDSERVE_DISABLE_KERNELS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {x.split()[0]: x.split()[1:] for x in proc.stdout.splitlines() if x.startswith(("NLL", "TOKENS"))}
    fallback = float(lines["NLL"][0])
    kernel = _nll(runners("int8"), embedded_tokenizer.encode(HELD_OUT))
    assert abs(fallback / kernel - 1) < 0.005, (fallback, kernel)
    assert [int(t) for t in lines["TOKENS"]] == greedy(runners("int8"), embedded_tokenizer.encode(COUNTING), 12)[0]
