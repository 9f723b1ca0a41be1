"""Quantized weights served as people download them: the embedded Q4_1 file computed on packed (the default), an
HF folder quantized at load, and a tensor-parallel split of packed weights.

The packed path multiplies int8 activations (per block of 32 inputs) by the file's codes, as llama.cpp does, so
it is not the exact path: what it must keep is the model's quality (a held-out text's likelihood within 1% of the
dequantized fp32 path's) and, where fp32 is sure of the next token, that token. PD and speculative decoding on
the packed model are test_pd.py's own runs (its servers take the default, gguf).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.kernels import cpu_ops
from pdserve.model import ForwardBatch, SequenceChunk, load_decoder
from pdserve.model.tensor_parallel import TensorParallel
from tests.teacher_forced import agreement_where_sure
from tests.test_gguf_types import TOKENS, gguf_file  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(cpu_ops() is None, reason="pdserve's kernels are not built here")]

HELD_OUT = ("The lighthouse keeper climbed the narrow stairs every evening, counting the steps as his father had "
            "done before him. From the top he could see the harbour, the fishing boats returning with the tide, "
            "and the long line of the coast fading into the mist. He lit the lamp, wound the clockwork that turned "
            "the lens, and wrote the time in the logbook, as he had done for thirty years.")
PROMPTS = ["Explain in a few sentences why the sky is blue.", "Write a short poem about the ocean."]
STEPS = 32


def _nll(runner, ids: list[int]) -> float:  # noqa: ANN001
    """Mean negative log-likelihood of ids[1:] given what precedes each (one prompt pass)."""
    runner.allocate_kv_cache(16)
    _, hidden = runner.logits_with_prompt([SequenceChunk(ids, 0, list(range(16)))], full_logits=[0])
    logprobs = torch.log_softmax(runner.project(hidden[0]).float(), dim=-1)
    return float(-logprobs[:-1].gather(1, torch.tensor(ids[1:]).view(-1, 1)).mean())


@pytest.fixture(scope="module")
def packed_runner():
    from pdserve.worker.model_runner import ModelRunner

    return ModelRunner(None, dtype="float32", device="cpu")  # a .gguf's default: its block formats, packed


@pytest.fixture(scope="module")
def q8_runner():
    """The embedded model's dequantized folder as a Hugging Face folder, quantized at load to Q8_0."""
    from pdserve.loader import resolve_model_folder
    from pdserve.worker.model_runner import ModelRunner

    return ModelRunner(resolve_model_folder(None, with_weights=True), dtype="float32", device="cpu",
                       quantization="q8_0")


def test_the_embedded_model_runs_packed_by_default(packed_runner, embedded_runner):
    from pdserve.model.quantized_linear import QuantLinear

    model = packed_runner.model
    assert packed_runner.quantization == "gguf"
    assert all(isinstance(lin, QuantLinear) for layer in model.layers for lin in layer.linears())
    assert model.embed_quantized is not None and model.lm_head_proj is model.embed_quantized  # tied, one copy
    # 4-5 bits a weight where the dequantized fp32 path holds 32
    assert model.weight_bytes() < 0.25 * embedded_runner.model.weight_bytes()


@pytest.mark.parametrize("which", ["packed_runner", "q8_runner"])
def test_held_out_likelihood_within_one_percent_of_fp32(which, request, embedded_runner, embedded_tokenizer):
    ids = embedded_tokenizer.encode(HELD_OUT)
    exact = _nll(embedded_runner, ids)
    quantized = _nll(request.getfixturevalue(which), ids)
    print(f"{which}: NLL {quantized:.4f} vs fp32 {exact:.4f} ({quantized / exact - 1:+.2%})")
    assert abs(quantized / exact - 1) <= 0.01


@pytest.mark.parametrize("which", ["packed_runner", "q8_runner"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_where_fp32_is_sure_the_quantized_model_agrees(which, prompt, request, embedded_runner, embedded_tokenizer):
    """Teacher-forced on fp32's greedy answer: the next token of each step, where fp32's top two are a logit or
    more apart."""
    runner = request.getfixturevalue(which)
    ids = embedded_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
    sure = agreement_where_sure(embedded_runner, runner, ids, STEPS)
    assert len(sure) >= STEPS // 4
    assert sum(sure) >= 0.9 * len(sure), f"{which} agreed with a sure fp32 on {sum(sure)}/{len(sure)}"


def _rank(rank: int, gguf: Path, folder: Path, rendezvous: Path, expected: torch.Tensor) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        model = load_decoder(folder, torch.float32, torch.device("cpu"), quantization="gguf",
                             tp=TensorParallel(rank, 2), gguf_file=gguf)
        logits = model(ForwardBatch.build([SequenceChunk(TOKENS, 0, [0])], 64, is_dummy_or_profile_run=True), None)
        # the ranks' partial sums add in another order than one rank's: float rounding, nothing more
        torch.testing.assert_close(logits[0], expected, atol=2e-3 * float(expected.abs().max()), rtol=0)
    finally:
        dist.destroy_process_group()


def test_two_ranks_of_packed_weights_equal_the_unsplit_model(gguf_file, tmp_path, monkeypatch):  # noqa: F811
    """Every block format split at whole blocks of 32 (K-quants inside their super-blocks of 256)."""
    from pdserve.loader import resolve_model_folder

    with monkeypatch.context() as m:  # the converted folder in tmp_path; the ranks find the kernels where they are
        m.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
        folder = resolve_model_folder(gguf_file)
    whole = load_decoder(folder, torch.float32, torch.device("cpu"), quantization="gguf", gguf_file=gguf_file)
    expected = whole(ForwardBatch.build([SequenceChunk(TOKENS, 0, [0])], 64, is_dummy_or_profile_run=True), None)[0]
    mp.spawn(_rank, args=(gguf_file, folder, tmp_path / "rendezvous", expected), nprocs=2, join=True)


def test_quantization_that_does_not_fit_the_model_is_refused(tmp_path):
    from pdserve.config.errors import ModelLoadError
    from pdserve.loader.quantization import resolve_quantization

    with pytest.raises(ModelLoadError, match="quantizes a Hugging Face folder at load"):
        resolve_quantization("q4_0", None, "cpu")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="needs a .gguf file"):
        resolve_quantization("gguf", tmp_path, "cpu")
    assert resolve_quantization(None, tmp_path, "cpu") is None  # a folder's default: dense
    assert resolve_quantization(None, None, "cuda") is None  # no CUDA kernel yet: dequantized at load
