"""Attention over the paged KV cache.

The fast path is pdserve's compiled CPU kernel (pdserve/kernels): one call per layer for the whole
step, reading K/V in place from the blocks. The fallback path (no C++ build, CUDA, or a profile run
without a cache) gathers K/V into padded buffers and calls torch's scaled_dot_product_attention. An 8-bit
cache (`QuantizedKV`) is read by the kernel as it is; the fallback widens what it gathers (model/kv_codes.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_ops
from pdserve.kv.cache import QuantizedKV
from pdserve.model import kv_codes
from pdserve.model.forward_batch import DecodeAttention, FallbackAttention, ForwardBatch, PrefillAttention


class GatherBuffers:
    """Reused destination memory for K/V gathered from the cache.

    A fresh tensor per gather would be first-touch memory every time (page faults run at ~1 GB/s
    here, a warm buffer at ~20 GB/s), so two buffers grow to the largest gather seen and stay.
    """

    def __init__(self) -> None:
        self._flat: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.numel() < numel or flat.dtype != like.dtype or flat.device != like.device:
            flat = torch.empty(max(numel, flat.numel() if flat is not None else 0), dtype=like.dtype,
                               device=like.device)
            self._flat[name] = flat
        return flat[:numel].view(shape)


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,
    cache: torch.Tensor | QuantizedKV | None,  # this layer's [blocks, 2 (K, V), block_size, kv_heads, head_dim]
    batch: ForwardBatch,
    scale: float,
    buffers: GatherBuffers,
    window: int = 0,  # a sliding-window layer's: a query sees only the last `window` keys (0: all before it)
) -> torch.Tensor:  # [T, heads * head_dim]
    if isinstance(cache, torch.Tensor) and cache.dtype != q.dtype:  # a full-width --kv-cache-dtype not the model's
        return paged_attention(q.to(cache.dtype), k.to(cache.dtype), v.to(cache.dtype), cache, batch, scale,
                               buffers, window).to(q.dtype)
    if batch.fallback is not None:
        fallback = batch.fallback.windowed(window, q.device) if window else batch.fallback
        return _gather_and_sdpa(q, k, v, cache, fallback, scale, buffers)
    assert cache is not None, "the paged kernel needs the KV cache"
    ops = cpu_ops()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if isinstance(cache, QuantizedKV):
        codes, scales = cache
        ops.write_kv_codes(k, v, codes[:, 0], codes[:, 1], scales[:, 0], scales[:, 1], batch.slots)
        ops.paged_attention(out, q, codes[:, 0], codes[:, 1], batch.block_tables, batch.seq_lens,
                            batch.query_start_loc, scale, scales[:, 0], scales[:, 1], window)
        return out.view(q.shape[0], -1)
    key_cache, value_cache = cache[:, 0], cache[:, 1]
    ops.write_kv(k, v, key_cache, value_cache, batch.slots)
    ops.paged_attention(out, q, key_cache, value_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                        scale, None, None, window)
    return out.view(q.shape[0], -1)


def _gather_and_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor | QuantizedKV | None,
                     batch: FallbackAttention, scale: float, buffers: GatherBuffers) -> torch.Tensor:
    if isinstance(cache, QuantizedKV):
        kv_codes.write(cache, k, v, batch.slot_blocks, batch.slot_offsets)
    elif cache is not None:
        cache[batch.slot_blocks, 0, batch.slot_offsets] = k
        cache[batch.slot_blocks, 1, batch.slot_offsets] = v
    num_tokens = q.shape[0]
    d = batch.decode
    if d is not None and d.is_whole_batch:  # a decode-only step: no scatter into an output buffer
        return _decode(q, cache, d, scale, buffers).view(num_tokens, -1)
    out = torch.empty_like(q)
    for p in batch.prefills:
        out[p.start:p.start + p.length] = _prefill(q, k, v, cache, p, scale, buffers)
    if d is not None:
        out[d.token_index] = _decode(q[d.token_index], cache, d, scale, buffers)
    return out.view(num_tokens, -1)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor | QuantizedKV | None,
             p: PrefillAttention, scale: float, buffers: GatherBuffers) -> torch.Tensor:  # [n, heads, d]
    heads, kv_heads = q.shape[1], k.shape[1]
    qs = q[p.start:p.start + p.length].transpose(0, 1)  # [heads, n, d]
    if p.block_ids is None:
        ks = k[p.start:p.start + p.length].transpose(0, 1)
        vs = v[p.start:p.start + p.length].transpose(0, 1)
    else:
        assert cache is not None, "a chunk continuing a cached prefix needs the KV cache"
        context = p.num_computed + p.length
        ks = _gather(cache, 0, p.block_ids, buffers, q.dtype).flatten(0, 1)[:context].transpose(0, 1)
        vs = _gather(cache, 1, p.block_ids, buffers, q.dtype).flatten(0, 1)[:context].transpose(0, 1)
    if heads != kv_heads:
        # Repeating K/V is cheaper than enable_gqa, which drops CPU SDPA to its slow math path.
        ks = ks.repeat_interleave(heads // kv_heads, dim=0)
        vs = vs.repeat_interleave(heads // kv_heads, dim=0)
    # 4-D inputs: with 3-D ones CPU SDPA also falls back to the math path.
    o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=p.mask, is_causal=p.mask is None,
                                       scale=scale)
    return o[0].transpose(0, 1)


def _decode(q: torch.Tensor, cache: torch.Tensor | QuantizedKV | None, d: DecodeAttention, scale: float,
            buffers: GatherBuffers) -> torch.Tensor:  # [B, heads, d]
    assert cache is not None, "decode tokens need the KV cache"
    b, heads, head_dim = q.shape
    kv_heads = (cache.codes if isinstance(cache, QuantizedKV) else cache).shape[-2]
    # Query heads grouped by their KV head ([B, kv_heads, group, d]): GQA without repeating K/V.
    qd = q.view(b, kv_heads, heads // kv_heads, head_dim)
    kd = _gather(cache, 0, d.block_tables, buffers, q.dtype).flatten(1, 2).transpose(1, 2)  # [B, kv_heads, L, d]
    vd = _gather(cache, 1, d.block_tables, buffers, q.dtype).flatten(1, 2).transpose(1, 2)
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=scale)
    return o.reshape(b, heads, head_dim)  # a view on CPU; CUDA's kernels may return another memory order


def _gather(cache: torch.Tensor | QuantizedKV, which: int, block_ids: torch.Tensor, buffers: GatherBuffers,
            dtype: torch.dtype) -> torch.Tensor:
    """K (which=0) or V (1) of the blocks `block_ids`, contiguous (so later flattens are views), written into a
    reused buffer; an 8-bit cache's widened to `dtype`.

    index_select is ~4x faster than advanced indexing on this strided per-layer view.
    """
    if isinstance(cache, QuantizedKV):
        return kv_codes.widen_blocks(cache, which, block_ids, dtype)
    blocks = cache[:, which]
    out = buffers.take("kv"[which], (*block_ids.shape, *blocks.shape[1:]), blocks)
    torch.index_select(blocks, 0, block_ids.reshape(-1), out=out.view(-1, *blocks.shape[1:]))
    return out
