"""8-bit KV caches (--kv-cache-dtype fp8 | fp8_e5m2 | int8): the kernel's writes equal the torch encoder's,
and the paged-attention kernel over codes equals attention over the same codes widened (dequantize, then
attend), for decode batches, short chunks and prefill chunks over cached prefixes, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout
from pdserve.model import kv_codes
from tests.test_attention_kernel import paged_batch, reference

HEAD_DIM = 64
CODES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# The worst relative error of one element against its row's largest: half a code step at the top of the range.
ROW_ERROR = {"int8": 0.5 / 127, "fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}


@pytest.mark.parametrize("name", list(CODES))
def test_encode_decode_error_is_within_one_code_step(name):
    x = torch.randn(200, 3, HEAD_DIM) * torch.logspace(-3, 3, 200)[:, None, None]
    codes, scales = kv_codes.encode(x, CODES[name])
    back = kv_codes.decode(codes, scales, torch.float32)
    row_max = x.abs().amax(-1, keepdim=True)
    assert ((back - x).abs() <= ROW_ERROR[name] * row_max * 1.01).all()
    zero_codes, zero_scales = kv_codes.encode(torch.zeros(2, HEAD_DIM), CODES[name])
    assert (kv_codes.decode(zero_codes, zero_scales, torch.float32) == 0).all()


def random_cache(name: str, num_blocks: int, block: int, kv_heads: int, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache.allocate(KVLayout(num_blocks, 1, block, kv_heads, HEAD_DIM, name), "cpu")
    layer = cache.layers[0]
    x = torch.randn(num_blocks, 2, block, kv_heads, HEAD_DIM, generator=g)
    codes, scales = kv_codes.encode(x, layer.codes.dtype)
    layer.codes.view(torch.uint8).copy_(codes.view(torch.uint8))
    layer.scales.copy_(scales)
    return cache


def run_case(ops, name, dtype, heads, kv_heads, block, context, queries, seed=0, window=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block) for c in context) + 3
    layer = random_cache(name, num_blocks, block, kv_heads, seed).layers[0]
    seq_lens, starts, tables = paged_batch(context, queries, block, num_blocks, g)
    q = torch.randn(int(starts[-1]), heads, HEAD_DIM, generator=g).to(dtype)
    out = torch.empty_like(q)
    codes, scales = layer
    ops.paged_attention(out, q, codes[:, 0], codes[:, 1], tables, seq_lens, starts, HEAD_DIM ** -0.5,
                        scales[:, 0], scales[:, 1], window)
    widened = kv_codes.decode(codes, scales, torch.float32)
    return out, reference(q, widened[:, 0], widened[:, 1], tables, seq_lens, starts, HEAD_DIM ** -0.5, window)


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CODES))
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)], ids=lambda x: str(x))
def test_decode_over_codes_equals_attention_over_widened_codes(ops, name, dtype, heads, kv_heads):
    context = [1, 15, 16, 17, 64, 65, 300, 1999]
    out, ref = run_case(ops, name, dtype, heads, kv_heads, 16, context, [1] * len(context))
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CODES))
def test_a_sliding_window_over_codes_sees_only_its_last_keys(ops, name, dtype):
    """An 8-bit cache under a sliding-window layer: decodes, few-query chunks and prefills see only their window."""
    context = [40, 600, 23, 130, 1000, 157, 520]
    queries = [1, 1, 23, 3, 200, 60, 520]
    out, ref = run_case(ops, name, dtype, 8, 2, 16, context, queries, seed=3, window=37)
    torch.testing.assert_close(out.float(), ref.float(), atol=2 * TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CODES))
def test_prefill_chunks_over_codes_equal_attention_over_widened_codes(ops, name, dtype):
    # decode, fresh prefill, a chunk continuing a cached prefix, short chunks, a long fresh prefill
    context = [40, 23, 2 * 16 + 11, 1000, 700, 157, 3, 64]
    queries = [1, 23, 11, 1, 700, 60, 2, 4]
    out, ref = run_case(ops, name, dtype, 9, 3, 16, context, queries, seed=1)
    # bf16 queries widen a prefill block's codes to bf16 before the dot products: one more rounding
    torch.testing.assert_close(out.float(), ref.float(), atol=2 * TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CODES))
def test_kernel_writes_the_codes_and_scales_torch_encodes(ops, name, dtype):
    cache = KVCache.allocate(KVLayout(6, 1, 4, 3, HEAD_DIM, name), "cpu")
    codes, scales = cache.layers[0]
    k = (torch.randn(5, 3, HEAD_DIM) * 7).to(dtype)
    v = torch.randn(5, 3, HEAD_DIM).to(dtype)
    v[2, 1] = 0  # an all-zero row: scale 0, codes 0
    slots = torch.tensor([0, 3, 4, 21, 9])
    ops.write_kv_codes(k, v, codes[:, 0], codes[:, 1], scales[:, 0], scales[:, 1], slots)
    for which, x in enumerate((k, v)):
        want_codes, want_scales = kv_codes.encode(x, codes.dtype)
        got_codes = codes[slots // 4, which, slots % 4]
        assert torch.equal(got_codes.view(torch.uint8), want_codes.view(torch.uint8))
        assert torch.equal(scales[slots // 4, which, slots % 4], want_scales)
    codes.view(torch.uint8)[slots // 4, :, slots % 4] = 0
    scales[slots // 4, :, slots % 4] = 0
    assert not cache.tensor.any()  # nothing but the 5 slots was written
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.write_kv_codes(k, v, codes[:, 0], codes[:, 1], scales[:, 0], scales[:, 1], torch.tensor([0, 1, 2, 3, 24]))


def test_an_8bit_block_is_one_region_of_codes_then_scales():
    layout = KVLayout(4, 2, 16, 3, HEAD_DIM, "fp8_e4m3")
    full = KVLayout(4, 2, 16, 3, HEAD_DIM, "bfloat16")
    assert layout.layer_block_bytes == 2 * 16 * 3 * HEAD_DIM + 2 * 16 * 3 * 2
    assert full.block_bytes / layout.block_bytes >= 1.9  # the tokens a cache of one size holds
    cache = KVCache.allocate(layout, "cpu")
    cache.layers[1].codes[2, 1, 5, 2].fill_(1.0)
    cache.layers[1].scales[2, 0, 3, 2] = 2.0
    touched = cache.tensor.view(4, 2, -1).nonzero()[:, :2].unique(dim=0).tolist()
    assert touched == [[2, 1]]  # block 2, layer 1: nothing else
    share = cache.rank_view(2, 3)  # head 2 of 3
    assert share.layers[1].codes[2, 1, 5, 0, 0].item() == 1.0 and share.layers[1].scales[2, 0, 3, 0].item() == 2.0
