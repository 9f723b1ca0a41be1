"""The decoder (llama, mistral, qwen2, qwen3, ernie4_5, gemma3) over a paged KV cache.

Weights are fused at load time (q|k|v into one matrix, gate|up into one) so a layer is five
matmuls. Logits are computed only for each sequence's last token of the step. Gemma's (1 + weight) norms are
folded into their weights at load, so every norm is one RMSNorm.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.config.errors import ModelLoadError
from pdserve.config.model import ModelConfig
from pdserve.kernels import kernels_for
from pdserve.kv.cache import KVCache
from pdserve.loader.gguf_blocks import QuantizedMatrix
from pdserve.model import few_row_linear
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.linear import DenseLinear, Linear, PackedLinear, make_linear
from pdserve.model.paged_attention import GatherBuffers, paged_attention
from pdserve.model.quantized_linear import ConcatLinear, QuantLinear, kernel_refusal, quantized_linear
from pdserve.model.rope import RotaryEmbedding
from pdserve.model.tensor_parallel import TensorParallel

log = logging.getLogger("pdserve.model")


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


NORMS = ("input_norm", "post_norm", "attn_out_norm", "mlp_out_norm", "q_norm", "k_norm", "norm")


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        qkv = c.q_size + 2 * c.kv_size
        self.input_norm = _param(c.hidden_size, **kw)
        self.qkv = _param(qkv, c.hidden_size, **kw)
        self.qkv_bias = _param(qkv, **kw) if c.qkv_bias else None
        self.q_norm = _param(c.head_dim, **kw) if c.qk_norm else None
        self.k_norm = _param(c.head_dim, **kw) if c.qk_norm else None
        self.o = _param(c.hidden_size, c.q_size, **kw)
        self.o_bias = _param(c.hidden_size, **kw) if c.o_bias else None
        self.post_norm = _param(c.hidden_size, **kw)  # before the MLP
        # Gemma: the attention's and the MLP's outputs are normed before they join the residual stream.
        self.attn_out_norm = _param(c.hidden_size, **kw) if c.sandwich_norms else None
        self.mlp_out_norm = _param(c.hidden_size, **kw) if c.sandwich_norms else None
        self.gate_up = _param(2 * c.intermediate_size, c.hidden_size, **kw)
        self.gate_up_bias = _param(2 * c.intermediate_size, **kw) if c.mlp_bias else None
        self.down = _param(c.hidden_size, c.intermediate_size, **kw)
        self.down_bias = _param(c.hidden_size, **kw) if c.mlp_bias else None
        # GGUF block-format parts of a matrix, by parameter name: (first row, codes) as the file gave them
        self.quantized: dict[str, list[tuple[int, QuantizedMatrix]]] = {}

    def build_linears(self, quantization: str | None) -> None:
        """The callables the forward pass uses, built once the weights are loaded.

        A packed, quantized or int8 copy replaces its matrix, so the matrix itself is freed."""
        self.qkv_proj = self._linear("qkv", quantization)
        self.o_proj = self._linear("o", quantization)
        self.gate_up_proj = self._linear("gate_up", quantization)
        # w8a8 never takes down_proj: its input (after SwiGLU) has the outliers that per-tensor int8
        # activations cannot hold; quantizing it changed the embedded model's greedy text by token 4.
        # (GGUF's block formats scale activations per 32 inputs, which holds them.)
        self.down_proj = self._linear("down", None)
        self.quantized.clear()
        for name in ("qkv", "o", "gate_up", "down"):
            if not isinstance(getattr(self, f"{name}_proj"), DenseLinear):
                getattr(self, name).data = torch.empty(0, dtype=self.qkv.dtype, device=self.qkv.device)

    def _linear(self, name: str, quantization: str | None) -> Linear:
        weight, bias = getattr(self, name), getattr(self, f"{name}_bias")
        parts = sorted(self.quantized.get(name, []), key=lambda part: part[0])
        if parts and sum(p.shape[0] for _, p in parts) == weight.shape[0]:
            matrices = [p for _, p in parts]
            refusals = [r for p in matrices if (r := kernel_refusal(p, weight.device))]
            if not refusals:
                return quantized_linear(matrices, bias)
            _warn_once(f"a {name} matrix stays dequantized: {refusals[0]}")
        elif parts:
            _warn_once(f"a {name} matrix came partly unquantized: its block-format parts are dequantized")
        for start, part in parts:  # dequantized: no kernel here, or the matrix came partly dense
            weight.data[start:start + part.shape[0]].copy_(torch.from_numpy(part.dequantize()))
        return make_linear(weight, bias, quantization)

    def linears(self) -> list[Linear]:
        return [self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj]


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_positions: int | None = None,
                 quantization: str | None = None, tp: TensorParallel | None = None) -> None:
        super().__init__()
        device = torch.device(device)
        self.tp = tp or TensorParallel()
        self.full_config = config  # the checkpoint's shapes
        self.config = config = self.tp.shard_config(config)  # this rank's: its heads and MLP columns
        self.dtype = dtype
        kw = {"dtype": dtype, "device": device}
        self.embed = _param(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device) for _ in range(config.num_layers))
        self.norm = _param(config.hidden_size, **kw)
        self.lm_head = self.embed if config.tie_word_embeddings else _param(config.vocab_size, config.hidden_size, **kw)
        positions = max_positions or config.max_position_embeddings
        self.rope = RotaryEmbedding(config.rope, config.head_dim, positions, device)
        self.local_rope = (RotaryEmbedding(config.local_rope, config.head_dim, positions, device)
                           if config.local_rope is not None else self.rope)  # the sliding-window layers'
        self.scale = config.attention_scale or config.head_dim ** -0.5
        self.gather_buffers = GatherBuffers()
        # pdserve's compiled CPU kernels (attention, RoPE, SwiGLU, RMSNorm), or None: then torch ops, and
        # ForwardBatch must carry the gather + SDPA path's metadata.
        self.kernels = kernels_for(config, device)
        self.quantization = quantization
        self.lm_head_part: Linear | None = None
        self.embed_quantized: QuantLinear | None = None  # a GGUF token table kept in its block format
        self._quantized_top: dict[str, QuantizedMatrix] = {}

    @property
    def uses_paged_kernel(self) -> bool:
        return self.kernels is not None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache | None,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [num_seqs, vocab] (fp32) for the last token of each chunk in `batch`.

        `on_layer_done(i)` is called once layer i's K/V are in the cache (PD: the messager may send them).
        """
        c = self.config
        eps = c.rms_norm_eps
        ops = self.kernels

        def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return F.rms_norm(x, (x.shape[-1],), weight, eps) if ops is None else ops.rms_norm(x, weight, eps)

        # cos/sin rows of this step per RoPE (the local layers' may be the global one: looked up once then)
        cos_sin_of = {r: r.lookup(batch.positions) if ops is None else None for r in (self.rope, self.local_rope)}
        heads, kv_heads, head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        h = (F.embedding(batch.input_ids, self.embed) if self.embed_quantized is None
             else self.embed_quantized.rows(batch.input_ids, self.dtype))
        if c.embed_scale != 1.0:
            h = h * torch.tensor(c.embed_scale, dtype=h.dtype)  # in the model's dtype, as the checkpoint was trained
        lora = batch.lora
        layers = self.layers if batch.num_layers is None else self.layers[:batch.num_layers]
        for i, layer in enumerate(layers):
            x = rms_norm(h, layer.input_norm)
            qkv = layer.qkv_proj(x)
            if lora is not None:
                lora.add(qkv, x, i, "qkv")
            # q and k heads side by side, so RoPE runs once per layer.
            qk = qkv[:, :c.q_size + c.kv_size].view(-1, heads + kv_heads, head_dim)
            v = qkv[:, c.q_size + c.kv_size:].view(-1, kv_heads, head_dim)
            if layer.q_norm is not None and ops is not None:  # in place, in the projection's output
                ops.rms_norm_heads(qk[:, :heads], layer.q_norm, eps)
                ops.rms_norm_heads(qk[:, heads:], layer.k_norm, eps)
            elif layer.q_norm is not None:
                qk = torch.cat((F.rms_norm(qk[:, :heads], (head_dim,), layer.q_norm, eps),
                                F.rms_norm(qk[:, heads:], (head_dim,), layer.k_norm, eps)), dim=1)
            window = c.window(i)
            rope = self.local_rope if window else self.rope
            if ops is None:
                qk = rope.apply(qk, cos_sin_of[rope])
            else:  # in place, in the projection's output
                ops.rotary_embedding(qk, batch.positions, rope.cos, rope.sin, rope.interleaved)
            q, k = qk.split((heads, kv_heads), dim=1)
            cache, group = kv_cache.by_layer[i] if kv_cache is not None else (None, 0)
            attn = paged_attention(q, k, v, cache, batch.group(group), self.scale, self.gather_buffers, window)
            if on_layer_done is not None:  # this layer's K/V are written: send them while the MLP runs
                on_layer_done(i)
            h = self._add_block_output(h, layer.o_proj, attn, layer.attn_out_norm, rms_norm)
            if lora is not None:
                lora.add(h, attn, i, "o")
            x = rms_norm(h, layer.post_norm)
            gate_up = layer.gate_up_proj(x)
            if lora is not None:
                lora.add(gate_up, x, i, "gate_up")
            act = self._gated_activation(gate_up)
            h = self._add_block_output(h, layer.down_proj, act, layer.mlp_out_norm, rms_norm)
            if lora is not None:
                lora.add(h, act, i, "down")
        last = rms_norm(h[batch.logits_indices], self.norm)
        return last if batch.return_hidden else self.lm_head_proj(last).float()

    def _gated_activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up: SwiGLU, or Gemma's GeGLU (tanh GELU)."""
        gelu = self.config.activation == "gelu_tanh"
        if self.kernels is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
        act = gate_up.new_empty(gate_up.shape[0], self.config.intermediate_size)
        (self.kernels.gelu_tanh_and_mul if gelu else self.kernels.silu_and_mul)(act, gate_up)
        return act

    def _add_block_output(self, residual: torch.Tensor, linear: Linear, x: torch.Tensor,
                          out_norm: torch.Tensor | None, rms_norm: Callable) -> torch.Tensor:
        """residual + linear(x), or with Gemma's output norm residual + norm(linear(x))."""
        if out_norm is None:
            return self._add_row_parallel(residual, linear, x)
        out = linear(x)
        if self.tp.size > 1:
            out = self.tp.all_reduce(out)
        return residual.add_(rms_norm(out, out_norm))

    def _add_row_parallel(self, residual: torch.Tensor, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        """residual + linear(x), the product summed over the tensor-parallel ranks first."""
        if self.tp.size == 1:
            return linear.add_to(residual, x)
        return residual.add_(self.tp.all_reduce(linear(x)))  # the residual stream is this forward's own tensor

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the fused parameters; every parameter must be filled once."""
        c = self.config
        parts = self._weight_parts()
        expected = self._expected_weight_names()
        seen: set[str] = set()
        for name, tensor in tensors:
            if "rotary_emb" in name or (name == "lm_head.weight" and c.tie_word_embeddings):
                continue
            owner, attr, rows = self._target(name, parts)
            target = getattr(owner, attr, None) if owner is not None else None
            if target is None:
                raise ModelLoadError(f"unexpected weight {name!r} for a {c.model_type} model")
            pieces = name.split(".")
            tensor = self.tp.shard(pieces[-2] + (".bias" if pieces[-1] == "bias" else ""), tensor, self.full_config)
            dest = target.data[rows]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dest.shape)} from config.json")
            if isinstance(tensor, QuantizedMatrix):
                self._keep_quantized(owner, attr, rows, tensor)
            elif c.norm_offset and attr in NORMS:
                dest.copy_(tensor.float() + c.norm_offset)  # (1 + weight) in fp32, as the checkpoint's code does
            else:
                dest.copy_(tensor)
            seen.add(name)
        missing = sorted(expected - seen)
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise ModelLoadError(f"checkpoint is missing weights: {', '.join(missing[:3])}{more}")
        dense_quantization = self.quantization if self.quantization == "w8a8" else None
        for layer in self.layers:
            layer.build_linears(dense_quantization)
        self._build_head(dense_quantization)
        self._log_linears()

    def _weight_parts(self) -> dict[str, tuple[str, slice]]:
        """HF module name within a layer -> (our parameter name, the rows it fills)."""
        c = self.config
        q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
        parts = {
            "self_attn.q_proj": ("qkv", slice(0, q)),
            "self_attn.k_proj": ("qkv", slice(q, q + kv)),
            "self_attn.v_proj": ("qkv", slice(q + kv, q + 2 * kv)),
            "self_attn.o_proj": ("o", slice(None)),
            "self_attn.q_norm": ("q_norm", slice(None)),
            "self_attn.k_norm": ("k_norm", slice(None)),
            "mlp.gate_proj": ("gate_up", slice(0, inter)),
            "mlp.up_proj": ("gate_up", slice(inter, 2 * inter)),
            "mlp.down_proj": ("down", slice(None)),
            "input_layernorm": ("input_norm", slice(None)),
            "post_attention_layernorm": ("post_norm", slice(None)),
        }
        if c.sandwich_norms:  # Gemma's names: post_attention_layernorm norms the attention's output
            parts |= {"post_attention_layernorm": ("attn_out_norm", slice(None)),
                      "pre_feedforward_layernorm": ("post_norm", slice(None)),
                      "post_feedforward_layernorm": ("mlp_out_norm", slice(None))}
        return parts

    def _keep_quantized(self, owner: nn.Module, attr: str, rows: slice, matrix: QuantizedMatrix) -> None:
        if isinstance(owner, DecoderLayer):
            owner.quantized.setdefault(attr, []).append((rows.start or 0, matrix))
        else:
            self._quantized_top[attr] = matrix

    def _build_head(self, quantization: str | None) -> None:
        """The token table and the LM head (usually one matrix, tied), packed where they came quantized."""
        c = self.config
        device = self.embed.device
        top = self._quantized_top
        for attr, matrix in list(top.items()):
            if refusal := kernel_refusal(matrix, device):
                log.warning("%s stays dequantized: %s", attr, refusal)
                getattr(self, attr).data.copy_(torch.from_numpy(matrix.dequantize()))
                del top[attr]
        part = self.tp.part(c.vocab_size)
        split = self.tp.size > 1 and c.vocab_size % self.tp.size == 0
        if "embed" in top:
            self.embed_quantized = QuantLinear(top["embed"], None)
        head = top.get("embed" if c.tie_word_embeddings else "lm_head")
        if head is not None:
            self.lm_head_proj = self.embed_quantized if c.tie_word_embeddings else QuantLinear(head, None)
            self.lm_head_part = self._head_part(head.rows(part), quantization) if split else None
        else:
            # The lm_head is usually the embedding too (tied), so its matrix stays.
            self.lm_head_proj = make_linear(self.lm_head, None, quantization)
            self.lm_head_part = None  # tensor parallel: this rank's vocabulary share, for the sampled logits
            if split:
                self.lm_head_part = make_linear(self.lm_head[part], None, quantization)
        for attr in top:
            getattr(self, attr).data = torch.empty(0, dtype=self.dtype, device=device)
        top.clear()

    def _head_part(self, part: QuantizedMatrix, quantization: str | None) -> Linear:
        if kernel_refusal(part, self.embed.device) is None:
            return QuantLinear(part, None)
        return make_linear(torch.from_numpy(part.dequantize()).to(self.embed.device, self.dtype), None, quantization)

    def _log_linears(self) -> None:
        every = [lin for layer in self.layers for lin in layer.linears()] + [self.lm_head_proj]
        packed = [lin for lin in every if isinstance(lin, PackedLinear)]
        if packed:
            log.info("linears: %s", few_row_linear.describe(self.dtype, [lin.few_rows for lin in packed]))
        quantized = [lin.describe() for lin in every if isinstance(lin, QuantLinear | ConcatLinear)]
        if quantized:
            kinds = ", ".join(f"{quantized.count(k)} {k}" for k in sorted(set(quantized)))
            log.info("linears: %d of %d on pdserve's GGUF block-format kernel (%s; int8 activations)%s",
                     len(quantized), len(every), kinds,
                     "; the token table looked up from its packed rows" if self.embed_quantized else "")

    @property
    def vocab_parallel(self) -> bool:
        return self.lm_head_part is not None

    def vocab_parallel_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits of `hidden`'s rows, each rank projecting its share of the vocabulary: rank 0 gets them
        whole, the other ranks None (every rank must call it, with the same rows)."""
        with torch.inference_mode():
            return self.tp.gather_to_first(self.lm_head_part(hidden).float().contiguous())

    def weight_bytes(self) -> int:
        """Parameters plus the packed, quantized or int8 copies that replaced some of them (each counted once)."""
        dense = sum(p.numel() * p.element_size() for p in self.parameters())
        copies = [lin for layer in self.layers for lin in layer.linears()] + [self.lm_head_proj]
        copies += [self.lm_head_part] if self.lm_head_part is not None else []
        copies += [self.embed_quantized] if self.embed_quantized is not None else []
        unique = {id(lin): lin for lin in copies if not isinstance(lin, DenseLinear)}
        return dense + sum(lin.nbytes for lin in unique.values())

    def _target(self, name: str, parts: dict[str, tuple[str, slice]]) -> tuple[nn.Module | None, str, slice]:
        """(the module holding `name`'s parameter, its attribute, the rows `name` fills), or (None, "", ...)."""
        top = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
        if name in top:
            return self, top[name], slice(None)
        pieces = name.split(".")
        if len(pieces) < 5 or pieces[:2] != ["model", "layers"] or not pieces[2].isdigit():
            return None, "", slice(None)
        index = int(pieces[2])
        if index >= len(self.layers):
            return None, "", slice(None)
        module, kind = ".".join(pieces[3:-1]), pieces[-1]
        if module not in parts:
            return None, "", slice(None)
        param_name, rows = parts[module]
        if kind == "bias":
            param_name += "_bias"
        return self.layers[index], param_name, rows

    def _expected_weight_names(self) -> set[str]:
        c = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not c.tie_word_embeddings:
            names.add("lm_head.weight")
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            projections = ["q_proj", "k_proj", "v_proj", "o_proj"]
            names |= {f"{p}self_attn.{n}.weight" for n in projections}
            names |= {f"{p}mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
            names |= {f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"}
            if c.sandwich_norms:
                names |= {f"{p}pre_feedforward_layernorm.weight", f"{p}post_feedforward_layernorm.weight"}
            if c.qkv_bias:
                names |= {f"{p}self_attn.{n}.bias" for n in ("q_proj", "k_proj", "v_proj")}
            if c.o_bias:
                names.add(f"{p}self_attn.o_proj.bias")
            if c.mlp_bias:
                names |= {f"{p}mlp.{n}.bias" for n in ("gate_proj", "up_proj", "down_proj")}
            if c.qk_norm:
                names |= {f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"}
        return names

