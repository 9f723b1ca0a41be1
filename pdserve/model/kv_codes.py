"""8-bit K/V in torch: each (token, KV head) row of K or V as int8 or float8 codes and one bf16 scale (its
largest magnitude over the code's largest), as kernels/csrc/kv_codes.h writes and reads them. The paths
without the CPU kernels (CUDA, a build that failed, a profile run's gather) use these; the kernel tests
take them as the reference.
"""

from __future__ import annotations

import torch

from pdserve.kv.cache import QuantizedKV

CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def encode(x: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., head_dim]` as codes of the same shape and bf16 scales `[...]`."""
    top = CODE_MAX[code_dtype]
    scale = (x.float().abs().amax(dim=-1) / top).to(torch.bfloat16)
    s = scale.float().unsqueeze(-1)
    y = torch.where(s > 0, x.float() / torch.where(s > 0, s, 1.0), 0.0).clamp(-top, top)
    codes = y.round().to(torch.int8) if code_dtype == torch.int8 else y.to(code_dtype)
    return codes, scale


def decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes `[..., head_dim]` times their scales `[...]`, in `dtype`."""
    return (codes.float() * scales.float().unsqueeze(-1)).to(dtype)


def write(cache: QuantizedKV, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
    """k and v `[T, kv_heads, head_dim]` into the 8-bit layer at (block, offset) per token."""
    for i, x in enumerate((k, v)):
        codes, scales = encode(x, cache.codes.dtype)
        # index_put is not implemented for float8 tensors: the codes go in as bytes.
        cache.codes.view(torch.uint8)[blocks, i, offsets] = codes.view(torch.uint8)
        cache.scales[blocks, i, offsets] = scales


def widen_blocks(cache: QuantizedKV, which: int, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K (which=0) or V (1) of `block_ids` (any shape), widened:
    `[*block_ids.shape, block_size, kv_heads, head_dim]`."""
    ids = block_ids.reshape(-1)
    codes = cache.codes.view(torch.uint8)[:, which].index_select(0, ids).view(cache.codes.dtype)
    scales = cache.scales[:, which].index_select(0, ids)
    return decode(codes, scales, dtype).view(*block_ids.shape, *codes.shape[1:])
