"""The embedded model (SmolLM2-135M-Instruct GGUF) against transformers loading the same file."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import SequenceChunk
from pdserve.sampling import SamplingParams, SamplingRow

pytestmark = pytest.mark.e2e  # starts pdserve processes or loads the model: not in `make test-fast`

# Chat prompts of different lengths. Each was checked to keep the oracle's top-two logit margin above
# 0.01 for all 32 greedy steps, so an exact token match is a fair demand (the test re-checks it).
LONG_TEXT = (
    "The printing press, invented by Johannes Gutenberg around 1440, changed how knowledge spread across "
    "Europe. Before it, books were copied by hand, which made them rare and expensive. With movable type, "
    "printers could produce many copies quickly, and prices fell. Literacy rose as books became common, and "
    "new ideas in science, religion and politics travelled faster than ever before. Historians link the press "
    "to the Renaissance, the Reformation and the Scientific Revolution. "
) * 3
CHAT_PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about the ocean.",
    LONG_TEXT + "\nSummarize the text above in two sentences.",
]
NEW_TOKENS = 32
MIN_MARGIN = 0.01
LOGIT_TOL = 2e-3


def _hf_greedy(model, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=2)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, torch.cat(out.logits).float()


def _our_greedy(runner, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    runner.allocate_kv_cache(8)
    table = list(range(8))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    row = SamplingRow(params, prompt_ids, [], (2,))
    chunk = SequenceChunk(list(prompt_ids), 0, table)
    logits_seen = []
    for _ in range(NEW_TOKENS):
        logits = runner.logits([chunk])
        logits_seen.append(logits)
        token = int(runner.sampler(logits, [row]).token_ids[0])
        row.output_token_ids.append(token)
        chunk = SequenceChunk([token], len(prompt_ids) + len(row.output_token_ids) - 1, table)
    return row.output_token_ids, torch.cat(logits_seen)


@pytest.mark.parametrize("prompt", CHAT_PROMPTS, ids=lambda p: f"{len(p)}chars")
def test_greedy_matches_transformers(prompt, embedded_runner, embedded_tokenizer, hf_gguf_model):
    prompt_ids = embedded_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
    hf_tokens, hf_logits = _hf_greedy(hf_gguf_model, prompt_ids)
    top2 = hf_logits.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    assert margin > MIN_MARGIN, f"prompt has a near-tie (margin {margin:.4f}); pick another prompt"

    ours, our_logits = _our_greedy(embedded_runner, prompt_ids)
    assert ours == hf_tokens
    # Both sides' logits are raw (before the min-tokens EOS mask).
    assert (our_logits - hf_logits).abs().max().item() < LOGIT_TOL


def test_weights_equal_transformers_gguf_load(hf_gguf_model):
    """Our dequantize + Q/K un-permute gives exactly the tensors transformers builds from the GGUF: the fp32 folder
    of --quantization none, and the codes, scales and mins the packed path keeps (Q4_1 and Q8_0 here).

    (Read from the loaders: the model itself keeps only packed copies of its projections.)"""
    from pdserve.loader import resolve_model_folder
    from pdserve.loader.default_model import default_model_path
    from pdserve.loader.gguf_tensors import iter_gguf_tensors
    from pdserve.loader.hf_folder import iter_tensors

    hf = hf_gguf_model.state_dict()
    names = {f"model.layers.7.self_attn.{p}.weight" for p in ("q_proj", "k_proj")}
    names |= {"model.layers.7.mlp.down_proj.weight", "model.embed_tokens.weight"}
    folder = resolve_model_folder(None, with_weights=True)
    dequantized = {name: t for name, t in iter_tensors(folder) if name in names}
    packed = {name: torch.from_numpy(m.dequantize()) for name, m in iter_gguf_tensors(default_model_path(), folder)
              if name in names}
    assert dequantized.keys() == packed.keys() == names
    for name in names:
        assert torch.equal(dequantized[name], hf[name]), name
        assert torch.equal(packed[name], hf[name]), name


TOKENIZER_TEXTS = [
    "In 2024 there were 12345 apples.",
    "Hello\n\nworld  x",
    "Unicode: naïve café, 日本語, emoji 🚀🔥, Ελληνικά.",
    "  leading spaces and\ttabs\r\nand CRLF",
    "<|im_start|>user\nspecial tokens stay whole<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
    "",
]


@pytest.mark.parametrize("text", TOKENIZER_TEXTS)
def test_tokenizer_matches_transformers(text, embedded_tokenizer, hf_gguf_tokenizer):
    ids = embedded_tokenizer.encode(text)
    assert ids == hf_gguf_tokenizer.encode(text, add_special_tokens=True)
    assert embedded_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert embedded_tokenizer.decode(ids) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=True)


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=lambda m: f"{len(m)}msgs")
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(messages, add_generation_prompt, embedded_tokenizer, hf_gguf_tokenizer):
    ours = embedded_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                   tokenize=False)
    assert ours == theirs
    ours_ids = embedded_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=True)
    theirs_ids = hf_gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                       tokenize=True, return_dict=False)
    assert ours_ids == list(theirs_ids)


def test_eos_and_bos_from_gguf_metadata(embedded_tokenizer, embedded_runner):
    assert embedded_tokenizer.eos_token == "<|im_end|>" and embedded_tokenizer.eos_token_ids == (2,)
    assert embedded_tokenizer.bos_token_id == 1 and not embedded_tokenizer.add_bos_token
    assert embedded_runner.config.eos_token_ids == (2,)
