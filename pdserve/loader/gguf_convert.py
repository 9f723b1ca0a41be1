"""Turn a GGUF file into a Hugging Face style folder, once, and cache it.

Reading a GGUF's metadata costs seconds (parsing ~50k tokenizer strings), so `config.json`,
`tokenizer.json`, `tokenizer_config.json` and `gguf-source.json` (the file's digest) are written under the
user cache folder keyed by the file's hash; every process reads the model's shape and tokenizer from there.
The weights stay in the GGUF file (loader/gguf_tensors.py reads them packed) unless the dequantized path is
asked for (`--quantization none`): only then is `model.safetensors` (fp32, HF names and layout) written too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.config.errors import ModelLoadError

if TYPE_CHECKING:  # numpy loads only to convert: the router and API server just read the cached folder
    import numpy as np

# GGUF architecture name -> HF model_type. llama.cpp stores Llama-arch Q/K rows permuted for its
# interleaved RoPE; qwen2/qwen3 use NEOX RoPE in llama.cpp and are stored unpermuted.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
PERMUTED_QK_ARCHITECTURES = {"llama"}
# Gemma's norms scale by (1 + weight); llama.cpp stores weight + 1 so that its RMSNorm applies as it is. The HF
# weight is what the file holds minus this.
NORM_OFFSETS = {"gemma3_text": 1.0}
GEMMA3_LOCAL_ROPE_THETA = 10_000.0  # not in the file: llama.cpp's and transformers' constant
GEMMA3_GLOBAL_EVERY = 6  # every sixth layer attends globally, the rest within the sliding window

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`; None means the GPT-2 byte-level default.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None, "gpt2": None, "smollm": None,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def cache_root() -> Path:
    if env := os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve"


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


METADATA_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "gguf-source.json")
OPTIONAL_FILES = ("generation_config.json",)  # the ids that end an answer, where the file's EOS is not all of them


def converted_folder(gguf_path: Path, with_weights: bool = False) -> Path:
    """The cached HF-style folder for `gguf_path` (config and tokenizer), converting it first if needed;
    `with_weights`: with the dequantized fp32 weights too."""
    digest = file_digest(gguf_path)
    target = cache_root() / f"gguf-{digest[:24]}"
    if not all((target / name).is_file() for name in METADATA_FILES):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
        tmp.chmod(0o755)
        try:
            convert_gguf(gguf_path, tmp, digest)
            if target.is_dir():  # an older cache (or another process) left a folder there: refresh its files
                for name in (*METADATA_FILES, *OPTIONAL_FILES):
                    if (tmp / name).is_file():
                        os.replace(tmp / name, target / name)
            else:
                try:
                    tmp.rename(target)
                except OSError:  # another process converted it meanwhile
                    pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if with_weights and not (target / "model.safetensors").is_file():
        _write_dequantized(gguf_path, target)
    return target


def open_gguf(gguf_path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(gguf_path)
    except Exception as e:  # the gguf package raises assorted errors on a bad file
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def architecture(reader: Any, gguf_path: Path) -> str:
    arch = _Metadata(reader).get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r} in {gguf_path.name}; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def convert_gguf(gguf_path: Path, out: Path, digest: str) -> None:
    reader = open_gguf(gguf_path)
    meta = _Metadata(reader)
    arch = architecture(reader, gguf_path)
    config = _hf_config(meta, arch, {t.name for t in reader.tensors})
    tokenizer, tokenizer_config, generation_config = _tokenizer_files(meta, arch)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    if generation_config:
        (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    (out / "gguf-source.json").write_text(json.dumps({"file": gguf_path.name, "sha256": digest}))


def _write_dequantized(gguf_path: Path, folder: Path) -> None:
    from safetensors.numpy import save_file

    reader = open_gguf(gguf_path)
    config = json.loads((folder / "config.json").read_text())
    tensors = _hf_tensors(reader, architecture(reader, gguf_path), config)
    tmp = folder / f".model.safetensors.{os.getpid()}.tmp"
    try:
        save_file(tensors, str(tmp))
        os.replace(tmp, folder / "model.safetensors")
    finally:
        tmp.unlink(missing_ok=True)


class _Metadata:
    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata is missing {key!r}")
        return value


def _hf_config(meta: _Metadata, arch: str, tensor_names: set[str]) -> dict[str, Any]:
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError("GGUF files with rope_freqs (Llama 3.1 RoPE scaling) are not supported yet; "
                             "use the Hugging Face folder")
    heads = int(meta.require(f"{arch}.attention.head_count"))
    hidden = int(meta.require(f"{arch}.embedding_length"))
    tokens = meta.require("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "gemma3": "Gemma3ForCausalLM"}[arch]],
        "model_type": GGUF_ARCHITECTURES[arch],
        "vocab_size": int(meta.get(f"{arch}.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(meta.require(f"{arch}.rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"unsupported GGUF RoPE scaling {scaling!r}")
    if arch == "gemma3":
        _gemma3_config(config, meta)
    return config


def _gemma3_config(config: dict[str, Any], meta: _Metadata) -> None:
    """What a Gemma 3 file leaves to the architecture: the layer pattern, the local layers' RoPE, GeGLU, the
    attention scale (llama.cpp: 1/sqrt(head_dim) but for the 27B model)."""
    layers = config["num_hidden_layers"]
    full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    if "rope_scaling" in config:  # the larger models scale the global layers' RoPE only
        full.update(config.pop("rope_scaling"))
    config.update({
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": int(meta.require("gemma3.attention.sliding_window")),
        "layer_types": ["full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
                        for i in range(layers)],
        "rope_parameters": {"full_attention": full,
                            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA}},
        "query_pre_attn_scalar": (config["hidden_size"] // config["num_attention_heads"] if layers == 62
                                  else config["head_dim"]),
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    })


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"}
_LAYER_NAMES_BY_TYPE = {"gemma3_text": _GEMMA3_LAYER_NAMES}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str, model_type: str = "llama") -> str:
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    layer_names = _LAYER_NAMES_BY_TYPE.get(model_type, _LAYER_NAMES)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise ModelLoadError(f"unexpected tensor {gguf_name!r} in GGUF file")


def norm_offset(model_type: str, hf: str) -> float:
    """What the file adds to this tensor beyond the HF weight (Gemma's norms: 1)."""
    return NORM_OFFSETS.get(model_type, 0.0) if hf.endswith("norm.weight") else 0.0


def needs_unpermute(arch: str, name: str) -> bool:
    return arch in PERMUTED_QK_ARCHITECTURES and (".q_proj." in name or ".k_proj." in name)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # Undo llama.cpp's per-head row interleave so HF's rotate_half RoPE applies.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tensors(reader: Any, arch: str, config: dict[str, Any]) -> dict[str, np.ndarray]:
    import numpy as np
    from gguf.quants import dequantize
    from tqdm import tqdm

    out: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="dequantizing GGUF (first start only)", unit="tensor", leave=False):
        name = hf_name(t.name, config["model_type"])
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError:
            raise ModelLoadError(f"GGUF tensor type {t.tensor_type.name} ({t.name}) is not supported") from None
        if offset := norm_offset(config["model_type"], name):
            w = w - np.float32(offset)
        # GGUF lists dims innermost first; dequantize returns numpy (row-major) order already.
        if needs_unpermute(arch, name):
            n = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            w = unpermute(w, n)
        out[name] = np.ascontiguousarray(w)
    return out


def _tokenizer_files(meta: _Metadata, arch: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(the tokenizers.Tokenizer, tokenizer_config, generation_config: {} when the file's EOS says it all)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama" and arch == "gemma3":
        from pdserve.loader.gguf_sentencepiece import gemma_tokenizer_files

        return gemma_tokenizer_files(meta)
    if kind != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE, 'gpt2', and "
                             "Gemma's SentencePiece vocabulary); use the Hugging Face folder")
    return (*_byte_level_tokenizer_files(meta), {})


def _byte_level_tokenizer_files(meta: _Metadata) -> tuple[Any, dict[str, Any]]:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported")
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    vocab = {tok: i for i, tok in enumerate(tokens)}

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=False) if ty == TOKEN_TYPE_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types, strict=False) if ty == TOKEN_TYPE_USER_DEFINED])

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None else None

    tokenizer_config = {
        "bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return tok, tokenizer_config
