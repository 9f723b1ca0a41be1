"""A synthetic Llama GGUF using every tensor type we promise, against transformers loading the same file: exactly on
the dequantized path (--quantization none), closely on the packed one (gguf: int8 activations)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.loader import resolve_model_folder
from pdserve.model import ForwardBatch, SequenceChunk, load_decoder

# K-quants need rows of 256. Five layers: the types rotate through the tensors, so layer 4's q, k and v are all
# block formats, each a different one (the packed path runs them side by side).
HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 256, 4, 2, 5, 97


def _k_quant_bytes(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random but well-formed K-quant blocks (gguf-py cannot quantize to them): sane fp16 super-scales."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    # Q4_K starts with fp16 d and dmin; Q6_K ends with fp16 d.
    scales = data[..., :4].view(np.float16) if qtype == T.Q4_K else data[..., size - 2:].view(np.float16)
    scales[...] = rng.uniform(0.001, 0.01, size=scales.shape).astype(np.float16)
    return data.reshape(rows, -1)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter layout for Llama Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter, quants
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(list(bytes_to_unicode().values())[:VOCAB])
    w.add_token_types([1] * VOCAB)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def add(name: str, shape: tuple[int, ...], qtype: T, n_head: int | None = None) -> None:
        if qtype in (T.Q4_K, T.Q6_K):
            data = _k_quant_bytes(qtype, *shape, rng)
            w.add_tensor(name, data, raw_dtype=qtype)
            return
        x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if n_head:
            x = _permute(x, n_head)
        if qtype == T.F32:
            w.add_tensor(name, x)
        elif qtype == T.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, quants.quantize(x, qtype), raw_dtype=qtype)

    norm = lambda n: w.add_tensor(n, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))  # noqa: E731
    add("token_embd.weight", (VOCAB, HIDDEN), T.Q8_0)
    types = [T.Q4_0, T.Q4_1, T.F16, T.BF16, T.Q4_K, T.Q6_K, T.Q8_0, T.F32]
    for i in range(LAYERS):
        t = types[i:] + types[:i]  # each tensor kind sees two types
        add(f"blk.{i}.attn_q.weight", (HEADS * 64, HIDDEN), t[0], n_head=HEADS)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * 64, HIDDEN), t[1], n_head=KV_HEADS)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * 64, HIDDEN), t[2])
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HEADS * 64), t[3])
        add(f"blk.{i}.ffn_gate.weight", (INTER, HIDDEN), t[4])
        add(f"blk.{i}.ffn_up.weight", (INTER, HIDDEN), t[5])
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, INTER), t[6])
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
    norm("output_norm.weight")
    add("output.weight", (VOCAB, HIDDEN), T.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TOKENS = [(i * 13 + 5) % VOCAB for i in range(40)]


@pytest.fixture(scope="module")
def expected(gguf_file) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([TOKENS])).logits[0, -1]
    assert logits.abs().max() > 1.0  # the weights are not degenerate
    return logits


def _logits(model) -> torch.Tensor:
    return model(ForwardBatch.build([SequenceChunk(TOKENS, 0, [0])], 64, is_dummy_or_profile_run=True), None)[0]


def test_all_tensor_types_match_transformers(gguf_file, expected, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    ours = load_decoder(resolve_model_folder(gguf_file, with_weights=True), torch.float32, torch.device("cpu"))
    assert not ours.config.tie_word_embeddings
    torch.testing.assert_close(_logits(ours), expected, atol=1e-4, rtol=1e-4)


def test_packed_tensor_types_stay_close_to_transformers(gguf_file, expected, tmp_path, monkeypatch, caplog):
    """Every block format on its kernel (mixed q/k/v formats side by side); what cannot be packed (a 97-row
    vocabulary, q|k|v partly F16) is dequantized at load, with a warning where a table stays dequantized."""
    from pdserve.model.quantized_linear import ConcatLinear, QuantLinear

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    with caplog.at_level("INFO"):
        ours = load_decoder(resolve_model_folder(gguf_file), torch.float32, torch.device("cpu"), quantization="gguf",
                            gguf_file=gguf_file)
    if ours.kernels is None:
        pytest.skip("pdserve's kernels are not built here")
    kinds = {type(lin) for layer in ours.layers for lin in layer.linears()}
    assert QuantLinear in kinds and ConcatLinear in kinds, kinds
    assert isinstance(ours.layers[4].qkv_proj, ConcatLinear)  # Q4_K | Q6_K | Q8_0
    assert "lm_head stays dequantized: 97 outputs" in caplog.text
    assert "on pdserve's GGUF block-format kernel" in caplog.text
    got = _logits(ours)
    assert (got - expected).abs().max() <= 0.03 * expected.abs().max(), (got - expected).abs().max()
    assert int(got.argmax()) == int(expected.argmax())
