"""Each supported architecture against transformers' own forward, through our loader and paged cache."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout
from pdserve.model import ForwardBatch, SequenceChunk, load_decoder
from tests.tiny_models import ARCHITECTURES, hf_logits, make_tiny_model

TOL = 1e-4
BLOCK = 8
PROMPT = [(i * 37 + 11) % 97 for i in range(45)]  # crosses five 8-token block boundaries


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_model(request.param, folder)
    ours = load_decoder(folder, torch.float32, torch.device("cpu"))
    return ours, hf_logits(hf, PROMPT)


def _cache(model, blocks: int = 16) -> KVCache:
    return KVCache.allocate(KVLayout.for_model(model.config, blocks, BLOCK, torch.float32), "cpu")


def _run(model, cache, chunks, block_size=BLOCK, kernel: bool = False) -> torch.Tensor:
    """One step on the gather + SDPA attention path, or with `kernel` on the compiled one."""
    return model(ForwardBatch.build(chunks, block_size, with_fallback=not kernel), cache)


def test_whole_prompt(arch):
    model, expected = arch
    cache = _cache(model)
    logits = _run(model, cache, [SequenceChunk(PROMPT, 0, list(range(16)))])
    torch.testing.assert_close(logits[0], expected[-1], atol=TOL, rtol=0)


def test_whole_prompt_without_cache(arch):
    """The profile-run path (no KV cache) computes the same logits."""
    model, expected = arch
    logits = model(ForwardBatch.build([SequenceChunk(PROMPT, 0, list(range(16)))], BLOCK,
                                      is_dummy_or_profile_run=True), None)
    torch.testing.assert_close(logits[0], expected[-1], atol=TOL, rtol=0)


@pytest.mark.parametrize("chunk", [5, 8, 13])
def test_prompt_in_chunks(arch, chunk):
    model, expected = arch
    cache = _cache(model)
    table = [15, 3, 9, 0, 7, 12, 1]  # scattered blocks: order comes from the table, not block ids
    for start in range(0, len(PROMPT), chunk):
        piece = PROMPT[start:start + chunk]
        logits = _run(model, cache, [SequenceChunk(piece, start, table)])
        torch.testing.assert_close(logits[0], expected[start + len(piece) - 1], atol=TOL, rtol=0)


@pytest.mark.parametrize("path", ["gather + SDPA", "compiled"])
def test_token_by_token(arch, path, ops):
    model, expected = arch
    if path == "compiled" and not model.uses_paged_kernel:
        pytest.skip("the model's shapes are not the compiled kernel's")
    cache = _cache(model)
    table = list(range(15, 8, -1))
    for pos, token in enumerate(PROMPT):
        logits = _run(model, cache, [SequenceChunk([token], pos, table)], kernel=path == "compiled")
        torch.testing.assert_close(logits[0], expected[pos], atol=TOL, rtol=0)


@pytest.mark.parametrize("chunk", [5, 13])
def test_prompt_in_chunks_on_the_compiled_kernel(arch, chunk, ops):
    model, expected = arch
    if not model.uses_paged_kernel:
        pytest.skip("the model's shapes are not the compiled kernel's")
    cache = _cache(model)
    table = [15, 3, 9, 0, 7, 12, 1]
    for start in range(0, len(PROMPT), chunk):
        piece = PROMPT[start:start + chunk]
        logits = _run(model, cache, [SequenceChunk(piece, start, table)], kernel=True)
        torch.testing.assert_close(logits[0], expected[start + len(piece) - 1], atol=TOL, rtol=0)


def test_a_multimodal_gemma3_checkpoint_serves_its_text_decoder(tmp_path):
    """A Gemma 3 checkpoint with a vision tower (model_type gemma3, the text config nested, the decoder's weights
    under language_model): its text decoder is loaded and answers as transformers' does on text."""
    import transformers

    from tests.tiny_models import ARCHITECTURES, COMMON

    _, extra = ARCHITECTURES["gemma3"]
    text = transformers.Gemma3TextConfig(**{**COMMON, **extra})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4)).eval()
    hf.save_pretrained(tmp_path)
    ours = load_decoder(tmp_path, torch.float32, torch.device("cpu"))
    assert ours.config.model_type == "gemma3_text" and ours.config.window(0) == 12
    logits = _run(ours, _cache(ours), [SequenceChunk(PROMPT, 0, list(range(16)))])
    torch.testing.assert_close(logits[0], hf_logits(hf, PROMPT)[-1], atol=TOL, rtol=0)


@pytest.mark.parametrize("path", ["gather + SDPA", "compiled"])
@pytest.mark.parametrize("chunk", [1, 5, 13])
def test_gemma3_with_a_block_table_per_layer_group_reads_only_the_windows_blocks(path, chunk, ops, tmp_path):
    """Gemma 3's sliding-window layer in a layer group of its own: its table points blocks that fell out of the
    window at a block of garbage (as a freed block reused by another request would be), and the answers are still
    transformers'. The global layer's group keeps every block."""
    from pdserve.config.layer_groups import LayerGroups

    hf = make_tiny_model("gemma3", tmp_path)
    model = load_decoder(tmp_path, torch.float32, torch.device("cpu"))
    expected = hf_logits(hf, PROMPT)
    groups = LayerGroups.by_window(tuple(model.config.window(i) for i in range(model.config.num_layers)))
    assert groups.layers == ((1,), (0,)) and groups.windows == (0, 12)
    cache = KVCache.allocate(KVLayout.for_model(model.config, 16, BLOCK, torch.float32, groups), "cpu")
    assert cache.layout.num_layers == 1
    garbage = 15
    cache.layers[0][garbage].fill_(1e4)
    full, window = [3, 9, 0, 7, 12, 1], [4, 10, 2, 8, 13, 5]
    for start in range(0, len(PROMPT), chunk):
        piece = PROMPT[start:start + chunk]
        live = groups.first_live_block(1, start, BLOCK)
        table = [garbage] * live + window[live:]
        logits = _run(model, cache, [SequenceChunk(piece, start, full, group_tables=[table])],
                      kernel=path == "compiled")
        torch.testing.assert_close(logits[0], expected[start + len(piece) - 1], atol=TOL, rtol=0)
        cache.layers[0][window[:live]].fill_(1e4)  # what fell out of the window is gone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_geglu_equals_torchs_gelu_tanh_times_up(ops, dtype) -> None:  # noqa: ANN001
    """Gemma's gelu_tanh(gate) * up in one pass (math in fp32, rounded once) against torch's two ops."""
    gate_up = (torch.randn(5, 2 * 640, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    out = gate_up.new_empty(5, 640)
    ops.gelu_tanh_and_mul(out, gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    assert torch.allclose(out.float(), want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
