"""The decoder split over tensor-parallel ranks (model/tensor_parallel.py) computes transformers' logits.

Two ranks in two processes over torch.distributed (gloo), each holding half of every attention and MLP
weight and a KV cache of its own KV heads, against transformers' forward of the whole model (fp32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.kv.cache import KVCache
from pdserve.kv.layout import KVLayout
from pdserve.model import ForwardBatch, SequenceChunk, load_decoder
from pdserve.model.load import load_config
from pdserve.model.tensor_parallel import TensorParallel
from tests.tiny_models import hf_logits, make_tiny_model

pytestmark = pytest.mark.e2e  # starts processes

TOL = 1e-4
BLOCK = 8
PROMPT = [(i * 37 + 11) % 97 for i in range(45)]
RANKS = 2


def _rank(rank: int, folder: Path, rendezvous: Path, expected: torch.Tensor) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=RANKS)
    try:
        model = load_decoder(folder, torch.float32, torch.device("cpu"), tp=TensorParallel(rank, RANKS))
        full = load_config(folder)
        local = model.config  # this rank's heads and MLP columns only
        assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (
            full.num_heads // RANKS, full.num_kv_heads // RANKS, full.intermediate_size // RANKS)
        cache = KVCache.allocate(KVLayout.for_model(model.config, 16, BLOCK, torch.float32), "cpu")
        whole = model(ForwardBatch.build([SequenceChunk(PROMPT[:-8], 0, list(range(16)))], BLOCK), cache)
        torch.testing.assert_close(whole[0], expected[len(PROMPT) - 9], atol=TOL, rtol=0)
        for pos in range(len(PROMPT) - 8, len(PROMPT)):  # decode steps reading the prompt's KV from the cache
            logits = model(ForwardBatch.build([SequenceChunk([PROMPT[pos]], pos, list(range(16)))], BLOCK), cache)
            torch.testing.assert_close(logits[0], expected[pos], atol=TOL, rtol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["llama-tied-bias", "qwen3"])
def test_two_ranks_compute_transformers_logits(arch: str, tmp_path: Path) -> None:
    hf = make_tiny_model(arch, tmp_path / "model")
    expected = hf_logits(hf, PROMPT)
    mp.spawn(_rank, args=(tmp_path / "model", tmp_path / "rendezvous", expected), nprocs=RANKS, join=True)


def test_a_model_whose_heads_do_not_divide_is_refused_naming_them() -> None:
    from pdserve.config.model import ModelConfig, RopeConfig

    config = ModelConfig("llama", 97, 576, 1536, 2, 9, 3, 64, 1e-5, 512, RopeConfig())  # SmolLM2-135M's heads
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        TensorParallel(0, 2).shard_config(config)
    assert TensorParallel(1, 3).shard_config(config).num_kv_heads == 1
    with pytest.raises(ValueError, match="3 KV heads"):
        TensorParallel(0, 9).shard_config(config)


def test_the_embedded_model_splits_at_three_and_a_generate_at_two_exits_2_naming_the_heads() -> None:
    import subprocess
    import sys

    from pdserve.loader import tensor_parallel_refusal
    from tests.servers import REPO

    assert tensor_parallel_refusal(None, 3) is None and tensor_parallel_refusal(None, 1) is None
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "-tp", "2", "--prompt", "Hi"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert "pdserve: error: --tensor-parallel-size 2 does not divide the model's 9 attention heads" in proc.stderr
    assert "Traceback" not in proc.stderr
