"""Paged attention: block boundaries, prompts continued after cached blocks, and mixed batches.

Every model-level test runs on both attention paths: the compiled kernel reading K/V in place
("kernel") and the gather + SDPA fallback pdserve uses when the kernel cannot be built ("fallback").
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_ops
from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout
from pdserve.model import ForwardBatch, SequenceChunk, load_decoder
from tests.tiny_models import hf_logits, make_tiny_model

TOL = 1e-4
BLOCK = 16


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    hf = make_tiny_model("qwen3", folder)
    return load_decoder(folder, torch.float32, torch.device("cpu")), hf


@pytest.fixture(params=["kernel", "fallback"])
def build(request):
    """ForwardBatch.build for one attention path."""
    if request.param == "kernel" and cpu_ops() is None:
        pytest.fail("the compiled attention kernel did not build on this machine (python -m pdserve.kernels)")
    fallback = request.param == "fallback"
    return lambda chunks, block_size: ForwardBatch.build(chunks, block_size, with_fallback=fallback)


def _cache(model) -> KVCache:
    return KVCache.allocate(KVLayout.for_model(model.config, 32, BLOCK, torch.float32), "cpu")


@pytest.mark.parametrize("length", [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 3 * BLOCK + 5])
def test_decode_across_block_boundaries(models, build, length):
    model, hf = models
    tokens = _prompt(length + 3, seed=length)
    expected = hf_logits(hf, tokens)
    cache = _cache(model)
    table = [4, 30, 2, 17, 9]
    model(build([SequenceChunk(tokens[:length], 0, table)], BLOCK), cache)
    for pos in range(length, length + 3):  # each decode writes at the next slot, maybe a new block
        logits = model(build([SequenceChunk([tokens[pos]], pos, table)], BLOCK), cache)
        torch.testing.assert_close(logits[0], expected[pos], atol=TOL, rtol=0)


def test_prompt_continued_after_cached_blocks(models, build):
    """Two full blocks already cached (e.g. a prefix-cache hit): only the rest is computed."""
    model, hf = models
    tokens = _prompt(2 * BLOCK + 11, seed=1)
    expected = hf_logits(hf, tokens)
    cache = _cache(model)
    model(build([SequenceChunk(tokens[:2 * BLOCK], 0, [6, 1, 20])], BLOCK), cache)
    # A second sequence shares the two cached blocks and continues into its own third block.
    logits = model(build([SequenceChunk(tokens[2 * BLOCK:], 2 * BLOCK, [6, 1, 25])], BLOCK), cache)
    torch.testing.assert_close(logits[0], expected[-1], atol=TOL, rtol=0)


def test_mixed_batch_equals_each_sequence_alone(models, build):
    model, _ = models
    a, b, c, d = _prompt(40, 2), _prompt(23, 3), _prompt(9, 4), _prompt(50, 5)
    tables = {"a": [0, 1, 2], "b": [10, 11], "c": [20], "d": [5, 6, 7, 8]}

    def alone(chunks_per_step):
        cache = _cache(model)
        return [model(build([ch], BLOCK), cache)[0] for ch in chunks_per_step]

    # Reference: each sequence on its own cache.
    ref_a = alone([SequenceChunk(a[:39], 0, tables["a"]), SequenceChunk(a[39:], 39, tables["a"])])[-1]
    ref_b = alone([SequenceChunk(b[:16], 0, tables["b"]), SequenceChunk(b[16:], 16, tables["b"])])[-1]
    ref_c = alone([SequenceChunk(c, 0, tables["c"])])[-1]
    ref_d = alone([SequenceChunk(d[:49], 0, tables["d"]), SequenceChunk(d[49:], 49, tables["d"])])[-1]

    cache = _cache(model)
    setup = [SequenceChunk(a[:39], 0, tables["a"]), SequenceChunk(b[:16], 0, tables["b"]),
             SequenceChunk(d[:49], 0, tables["d"])]
    model(build(setup, BLOCK), cache)
    # One step: decode a, a fresh prefill c, a continued prefill b, decode d (decodes not adjacent).
    step = [SequenceChunk(a[39:], 39, tables["a"]), SequenceChunk(c, 0, tables["c"]),
            SequenceChunk(b[16:], 16, tables["b"]), SequenceChunk(d[49:], 49, tables["d"])]
    batch = build(step, BLOCK)
    assert batch.query_start_loc.tolist() == [0, 1, 1 + 9, 1 + 9 + 7, 1 + 9 + 7 + 1]
    if batch.fallback is not None:
        assert batch.fallback.decode.token_index.tolist() == [0, 1 + 9 + 7]
    logits = model(batch, cache)
    for got, ref in zip(logits, [ref_a, ref_c, ref_b, ref_d], strict=True):
        torch.testing.assert_close(got, ref, atol=TOL, rtol=0)


def test_block_table_too_short_is_rejected():
    with pytest.raises(ValueError, match="cannot hold"):
        ForwardBatch.build([SequenceChunk(list(range(20)), 0, [0])], BLOCK)


def test_cache_layout_layer_of_block_is_contiguous(models, build):
    """'Layer L of block B' (K and V) is one contiguous region: the unit a P->D transfer sends."""
    model, _ = models
    cache = _cache(model)
    region = cache.tensor[3, 1]
    assert region.is_contiguous()
    assert region.numel() * region.element_size() == cache.layout.layer_block_bytes
    model(build([SequenceChunk(_prompt(5, 9), 0, [3])], BLOCK), cache)
    k, v = region  # written in place by the forward pass
    assert k[:5].abs().sum() > 0 and v[:5].abs().sum() > 0 and k[5:].abs().sum() == 0
