"""Small random-weight checkpoints saved by transformers, one per supported architecture."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2)

ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama-tied-bias": ("LlamaConfig", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "llama3-rope-scaling": ("LlamaConfig", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "ernie4_5": ("Ernie4_5Config", dict(use_bias=True, head_dim=16)),
    # a 12-token window on the first layer, full attention on the second: prompts of 45 tokens cross it
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
                                        layer_types=["sliding_attention", "full_attention"])),
}


def make_tiny_model(name: str, folder: Path, seed: int = 0):
    """Save a random model of architecture `name` into `folder`; returns the transformers model (fp32, eval)."""
    import transformers

    config_class, extra = ARCHITECTURES[name]
    config = getattr(transformers, config_class)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # biases and norms start at 0 / 1; randomise them so they are exercised
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of `token_ids` (one forward, no cache)."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def make_tiny_servable(folder: Path, name: str = "llama", seed: int = 0, **overrides):
    """A tiny random model that `pdserve serve` can run: the embedded model's tokenizer files and vocabulary
    size (so prompts are text), random weights of architecture `name`. Returns the transformers model."""
    import json
    import shutil

    import transformers

    from pdserve.loader import resolve_model_folder

    embedded = resolve_model_folder(None)
    vocab = json.loads((embedded / "config.json").read_text())["vocab_size"]
    config_class, extra = ARCHITECTURES[name]
    config = getattr(transformers, config_class)(**{**COMMON, **extra, "vocab_size": vocab, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    for f in embedded.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, folder / f.name)
    return model


NEW_TOKENS, MIN_MARGIN, NUM_PROMPTS = 12, 0.01, 8


def tiny_with_answers(folder: Path) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A tiny servable llama in `folder`, NUM_PROMPTS prompts (token ids) and transformers' greedy continuations of
    NEW_TOKENS each, chosen so that the top two logits stay more than MIN_MARGIN apart at every generated
    position: a difference is then a bug, not a tie."""
    hf = make_tiny_servable(folder)
    g = torch.Generator().manual_seed(1)
    prompts, answers = [], []
    while len(prompts) < NUM_PROMPTS:
        prompt = torch.randint(100, 49152, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g).tolist()
        if len(prompts) % 2 == 0:  # a repeated phrase: the n-gram proposer has something to propose
            prompt = prompt[:6] * 4
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        if min(gaps) > MIN_MARGIN:
            prompts.append(prompt)
            answers.append(out.sequences[0, len(prompt):].tolist())
    return folder, prompts, answers


def greedy_completions(url: str, prompts: list[list[int]]) -> list[str]:
    """The greedy text (NEW_TOKENS) of each prompt through the OpenAI API at `url`, all sent at once."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=120)

    def one(prompt: list[int]) -> str:
        r = client.completions.create(model="model", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def greedy_texts(folder: Path, answers: list[list[int]]) -> list[str]:
    from pdserve.tokenization.tokenizer import Tokenizer

    tokenizer = Tokenizer(folder)
    return [tokenizer.decode(a) for a in answers]
