"""Attention over the paged KV cache, with torch's scaled_dot_product_attention as the kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.model.forward_batch import ForwardBatch


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor] | None,  # this layer's K, V: [blocks, block_size, kv_heads, head_dim]
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:  # [T, heads * head_dim]
    if cache is not None:
        k_cache, v_cache = cache
        k_cache[batch.slot_blocks, batch.slot_offsets] = k
        v_cache[batch.slot_blocks, batch.slot_offsets] = v
    num_tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty_like(q)

    for p in batch.prefills:
        qs = q[p.start:p.start + p.length].transpose(0, 1)  # [heads, n, d]
        if p.block_ids is None:
            ks = k[p.start:p.start + p.length].transpose(0, 1)
            vs = v[p.start:p.start + p.length].transpose(0, 1)
        else:
            assert cache is not None, "a chunk continuing a cached prefix needs the KV cache"
            context = p.num_computed + p.length
            ks = k_cache[p.block_ids].flatten(0, 1)[:context].transpose(0, 1)
            vs = v_cache[p.block_ids].flatten(0, 1)[:context].transpose(0, 1)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, is_causal=p.mask is None,
                                           scale=scale, enable_gqa=heads != kv_heads)
        out[p.start:p.start + p.length] = o.transpose(0, 1)

    if (d := batch.decode) is not None:
        assert cache is not None, "decode tokens need the KV cache"
        b = d.token_index.shape[0]
        # Group query heads by their KV head ([B, kv_heads, group, d]): GQA without repeating K/V.
        qd = q[d.token_index].view(b, kv_heads, heads // kv_heads, head_dim)
        kd = k_cache[d.block_tables].flatten(1, 2).transpose(1, 2)  # [B, kv_heads, L, d]
        vd = v_cache[d.block_tables].flatten(1, 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=scale)
        out[d.token_index] = o.reshape(b, heads, head_dim)

    return out.view(num_tokens, heads * head_dim)
