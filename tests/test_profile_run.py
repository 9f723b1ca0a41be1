"""The profile run sizes the KV cache from memory left after weights and peak activations."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve import LLM
from pdserve.engine.engine_client import EngineError

pytestmark = pytest.mark.e2e  # starts pdserve processes or loads the model: not in `make test-fast`

GiB = 1 << 30


def _ready(**flags):
    flags.setdefault("dtype", "float32")  # the sizes below are fp32's, of dequantized weights
    flags.setdefault("quantization", "none")
    with LLM(max_model_len=1024, block_size=16, **flags) as llm:
        return llm.engine.ready


def test_profile_run_sizes_the_cache_from_the_flags():
    small_batch = _ready(kv_cache_memory=2 * GiB, max_num_batched_tokens=256)
    big_batch = _ready(kv_cache_memory=2 * GiB, max_num_batched_tokens=4096)
    low_util = _ready(kv_cache_memory=2 * GiB, max_num_batched_tokens=256, gpu_memory_utilization=0.6)
    p = small_batch.profile
    assert p["device_memory"] == 2 * GiB
    assert p["weights"] > 500e6  # the embedded model in fp32: 538 MB
    assert p["num_blocks"] == small_batch.num_blocks
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4  # layers x (K, V) x block_size x kv_heads x head_dim x fp32
    assert p["num_blocks"] == (int(2 * GiB * 0.9) - p["weights"] - p["peak_activations"]) // block_bytes
    assert big_batch.profile["peak_activations"] > p["peak_activations"]
    assert big_batch.num_blocks < small_batch.num_blocks
    assert low_util.num_blocks < small_batch.num_blocks


def test_block_override_skips_the_profile_run():
    ready = _ready(num_gpu_blocks_override=77)
    assert ready.num_blocks == 77 and ready.profile == {}


def test_impossible_config_fails_with_a_message():
    with pytest.raises(EngineError, match="--kv-cache-memory"):
        _ready(kv_cache_memory=600 << 20)


def test_impossible_config_exits_the_cli_non_zero():
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--prompt", "hi",
                           "--kv-cache-memory", "600M", "--dtype", "float32", "--quantization", "none"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "pdserve: error:" in proc.stderr and "--max-model-len" in proc.stderr
