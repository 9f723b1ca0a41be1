"""The compiled paged-attention kernel against torch's SDPA, and pdserve without it.

The reference gathers each sequence's K/V from its blocks and runs SDPA with an explicit causal
mask in fp32; the kernel must match it within the dtype's tolerance for any block table, context
lengths across block boundaries, GQA group sizes 1-8 and steps that mix decodes with prefill chunks
(fresh, and continuing a cached prefix).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import SequenceChunk

HEAD_DIM = 64


def reference(q, key_cache, value_cache, tables, seq_lens, starts, scale, window=0):
    out = torch.empty_like(q)
    group = q.shape[1] // key_cache.shape[2]
    block = key_cache.shape[1]
    for s in range(len(seq_lens)):
        length, a, b = int(seq_lens[s]), int(starts[s]), int(starts[s + 1])
        blocks = tables[s, :-(-length // block)].long()
        k = key_cache[blocks].flatten(0, 1)[:length].float().repeat_interleave(group, 1).transpose(0, 1)
        v = value_cache[blocks].flatten(0, 1)[:length].float().repeat_interleave(group, 1).transpose(0, 1)
        keys, positions = torch.arange(length)[None], torch.arange(length - (b - a), length)[:, None]
        mask = keys <= positions
        if window:
            mask &= keys > positions - window
        o = F.scaled_dot_product_attention(q[a:b].float().transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        out[a:b] = o.transpose(0, 1).to(q.dtype)
    return out


def paged_batch(context: list[int], queries: list[int], block: int, num_blocks: int,
                g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """seq_lens, query_start_loc and random, disjoint block tables for sequences of these lengths."""
    seq_lens = torch.tensor(context, dtype=torch.int32)
    starts = torch.zeros(len(context) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(queries).cumsum(0)
    max_blocks = max(-(-c // block) for c in context)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(context), max_blocks, dtype=torch.int32)
    used = 0
    for s, c in enumerate(context):
        n = -(-c // block)
        tables[s, :n] = perm[used:used + n].to(torch.int32)
        used += n
    return seq_lens, starts, tables


def run_case(ops, dtype, heads, kv_heads, block, context, queries, seed=0, window=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block) for c in context) + 3
    cache = torch.randn(num_blocks, 2, block, kv_heads, HEAD_DIM, generator=g).to(dtype)
    key_cache, value_cache = cache[:, 0], cache[:, 1]
    seq_lens, starts, tables = paged_batch(context, queries, block, num_blocks, g)
    q = torch.randn(int(starts[-1]), heads, HEAD_DIM, generator=g).to(dtype)
    out = torch.empty_like(q)
    ops.paged_attention(out, q, key_cache, value_cache, tables, seq_lens, starts, HEAD_DIM ** -0.5, None, None,
                        window)
    return out, reference(q, key_cache, value_cache, tables, seq_lens, starts, HEAD_DIM ** -0.5, window)


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}  # bf16: the output's own rounding step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (9, 3), (8, 1), (16, 2)], ids=lambda x: str(x))
def test_decode_batch_matches_sdpa(ops, dtype, heads, kv_heads):
    context = [1, 15, 16, 17, 63, 64, 65, 300, 1999, 2000]
    out, ref = run_case(ops, dtype, heads, kv_heads, 16, context, [1] * len(context))
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_seqs", [2, 24], ids=["one-head-items", "all-head-items"])
def test_short_chunks_match_sdpa(ops, dtype, num_seqs):
    # 1-4 queries per sequence with group size 2: few-row tiles whose rows see different lengths,
    # split by KV head for a small batch and one item per sequence for a large one
    context = [[3, 17, 64, 301][i % 4] for i in range(num_seqs)]
    queries = [[1, 2, 3, 4][i % 4] for i in range(num_seqs)]
    out, ref = run_case(ops, dtype, 8, 4, 16, context, queries, seed=2)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block", [16, 64])
def test_mixed_step_with_prefill_chunks_matches_sdpa(ops, dtype, block):
    # decode, fresh prefill, a chunk continuing a 2-block cached prefix, decode, a long fresh prefill,
    # a chunk continuing an unaligned prefix
    context = [40, 23, 2 * block + 11, 1000, 700, 157]
    queries = [1, 23, 11, 1, 700, 60]
    out, ref = run_case(ops, dtype, 9, 3, block, context, queries, seed=1)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seed", range(4))
def test_random_batches_match_sdpa(ops, seed, dtype):
    g = torch.Generator().manual_seed(100 + seed)
    kv_heads = int(torch.randint(1, 4, (1,), generator=g))
    group = int(torch.randint(1, 9, (1,), generator=g))
    num = int(torch.randint(1, 9, (1,), generator=g))
    context = torch.randint(1, 2001, (num,), generator=g).tolist()
    queries = [c if i % 3 == 0 else (1 if i % 3 == 1 else max(1, c // 3)) for i, c in enumerate(context)]
    out, ref = run_case(ops, dtype, kv_heads * group, kv_heads, 32, context, queries, seed=seed)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [1, 37, 64, 512])
def test_a_sliding_window_sees_only_its_last_keys(ops, dtype, window):
    """A sliding-window layer (Gemma 3's local layers): each query sees only the last `window` keys, itself
    included, in decodes, few-query chunks, fresh prefills and chunks continuing a cached prefix, whatever the
    window's place against the blocks."""
    context = [1, 40, 600, 2000, 23, 130, 1000, 700, 157, 5, 520]
    queries = [1, 1, 1, 1, 23, 3, 200, 700, 60, 2, 520]
    for block in (16, 64):
        out, ref = run_case(ops, dtype, 8, 2, block, context, queries, seed=window, window=window)
        torch.testing.assert_close(out.float(), ref.float(), atol=TOLERANCE[dtype], rtol=0)


def test_write_kv_puts_each_token_in_its_slot(ops):
    cache = torch.zeros(6, 2, 4, 3, HEAD_DIM)
    k, v = torch.randn(5, 3, HEAD_DIM), torch.randn(5, 3, HEAD_DIM)
    slots = torch.tensor([0, 3, 4, 21, 9])
    ops.write_kv(k, v, cache[:, 0], cache[:, 1], slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(cache[slot // 4, 0, slot % 4], k[t]) and torch.equal(cache[slot // 4, 1, slot % 4], v[t])
    assert cache.abs().sum(dim=(-1, -2)).count_nonzero() == 2 * 5
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.write_kv(k, v, cache[:, 0], cache[:, 1], torch.tensor([0, 1, 2, 3, 24]))


FALLBACK_SCRIPT = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from pdserve.kernels import cpu_ops
from pdserve.model import SequenceChunk
from pdserve.model import SequenceChunk
from pdserve.worker.model_runner import ModelRunner
assert cpu_ops() is None and cpu_ops() is None  # asked twice, said once
runner = ModelRunner(None, dtype="float32", device="cpu", quantization="none")
assert not runner.model.uses_paged_kernel
runner.allocate_kv_cache(4)
ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308]
out = [int(runner.logits([SequenceChunk(ids, 0, [0, 1])]).argmax())]
for i in range(7):
    out.append(int(runner.logits([SequenceChunk([out[-1]], len(ids) + i, [0, 1])]).argmax()))
print("TOKENS", json.dumps(out))
"""


def _tokens(env: dict[str, str]) -> tuple[list[int], str]:
    proc = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TOKENS"))
    return json.loads(line.removeprefix("TOKENS")), proc.stderr


@pytest.mark.e2e
def test_a_failed_build_falls_back_with_one_warning(tmp_path, ops, embedded_runner):
    # A compiler that does not exist, and an empty build cache: the build fails, pdserve runs on.
    tokens, log = _tokens({"CXX": str(tmp_path / "no-compiler"), "PDSERVE_CACHE_DIR": str(tmp_path)})
    assert log.count("could not be built") == 1, log
    # The same greedy tokens as the kernel path in this process.
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308]
    embedded_runner.allocate_kv_cache(4)
    expected = [int(embedded_runner.logits([SequenceChunk(ids, 0, [0, 1])]).argmax())]
    for i in range(7):
        expected.append(int(embedded_runner.logits([SequenceChunk([expected[-1]], len(ids) + i, [0, 1])]).argmax()))
    assert embedded_runner.model.uses_paged_kernel
    assert tokens == expected


def test_a_build_lock_left_by_a_killed_build_is_dropped(tmp_path):
    """torch's builder waits as long as its lock exists: an old one (a killed build) must not hang starts."""
    from pdserve.kernels import _drop_stale_lock

    old, fresh = tmp_path / "old", tmp_path / "fresh"
    old.touch()
    fresh.touch()
    os.utime(old, (0, 0))
    _drop_stale_lock(old)
    _drop_stale_lock(fresh)
    assert not old.exists() and fresh.exists()
