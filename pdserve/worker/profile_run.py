"""The profile run: size the KV cache from what is left after weights and peak activations.

    cache bytes = device memory x --gpu-memory-utilization - weights - peak activations

Device memory is the GPU's on CUDA; on CPU it is --kv-cache-memory when given, else the RAM
available now (less what other pdserve caches may still fill, at most /dev/shm's room) plus what this
process already holds for weights. Tensor-parallel ranks on a CPU share that memory: each sizes from its
1/N of it, for its 1/N of every block; the engine takes the smallest rank's count. Peak activations
come from a dummy forward of the first PROFILE_LAYERS layers at the largest batch the scheduler may
build (--max-num-batched-tokens tokens over up to --max-num-seqs sequences): the CUDA allocator's
peak, or on CPU the resident-set growth, sampled while it runs. The dummy run has no KV cache and is
flagged `is_dummy_or_profile_run`, so it signals nothing to any other component (seed 001, bug 2).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass

import psutil
import torch

from pdserve.config.engine import EngineConfig
from pdserve.model import SequenceChunk
from pdserve.utils.shm_room import free_host_memory
from pdserve.worker.model_runner import ModelRunner

log = logging.getLogger("pdserve.profile")
# Each layer frees its temporaries before the next starts, so a forward's peak is reached in its first
# layers. On CPU the resident-set growth of 4 layers equals the whole forward's within the sampling noise
# (SmolLM2-135M fp32, 2048 tokens: 130 MiB vs 120-150 MiB over runs) at 1/7 of its time (0.4 s vs 2.7 s).
PROFILE_LAYERS = 4


@dataclass
class ProfileResult:
    device_memory: int
    weights: int
    peak_activations: int
    cache_bytes: int
    num_blocks: int
    held_elsewhere: int = 0  # CUDA: memory in use that is not our weights (the context, other processes)

    def as_dict(self) -> dict:
        return asdict(self)


def dummy_chunks(config: EngineConfig, max_model_len: int) -> list[SequenceChunk]:
    tokens = config.max_num_batched_tokens
    seqs = max(1, min(config.max_num_seqs, tokens))
    base, extra = divmod(tokens, seqs)
    lengths = [min(base + (i < extra), max_model_len) for i in range(seqs)]
    blocks = -(-max(lengths) // config.block_size)
    return [SequenceChunk([0] * n, 0, [0] * blocks) for n in lengths if n > 0]


def profile_num_blocks(runner: ModelRunner, config: EngineConfig) -> ProfileResult:
    weights = runner.model.weight_bytes()
    chunks = dummy_chunks(config, runner.max_model_len)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        before = torch.cuda.memory_allocated(runner.device)
        runner.logits(chunks, is_dummy_or_profile_run=True, num_layers=PROFILE_LAYERS)
        torch.cuda.synchronize(runner.device)
        peak = torch.cuda.max_memory_allocated(runner.device) - before
        torch.cuda.empty_cache()  # what the profile run's activations reserved is not held elsewhere
        free, device_memory = torch.cuda.mem_get_info(runner.device)
        # Used now but not ours to size from: the CUDA context, other processes on the GPU (as the
        # peers subtract them; sizing from the total alone over-commits a shared or busy GPU).
        held_elsewhere = max(device_memory - free - torch.cuda.memory_allocated(runner.device), 0)
    else:
        peak = _cpu_peak_growth(lambda: runner.logits(chunks, is_dummy_or_profile_run=True, num_layers=PROFILE_LAYERS))
        ranks = runner.tp.size  # on one host's RAM
        device_memory = (config.kv_cache_memory or (free_host_memory() + ranks * weights)) // ranks
        held_elsewhere = 0
    layout = runner.layout(1).rank_share(runner.tp.size)
    cache_bytes = int(device_memory * config.gpu_memory_utilization) - weights - peak - held_elsewhere
    num_blocks = max(cache_bytes // layout.block_bytes, 0)
    result = ProfileResult(device_memory, weights, peak, cache_bytes, num_blocks, held_elsewhere)
    log.info("profile run: device memory %.2f GiB x %.2f - weights %.2f GiB - peak activations %.3f GiB "
             "- held elsewhere %.2f GiB = %.2f GiB for the KV cache", device_memory / 2**30,
             config.gpu_memory_utilization, weights / 2**30, peak / 2**30, held_elsewhere / 2**30,
             cache_bytes / 2**30)
    return result


def _cpu_peak_growth(run) -> int:  # noqa: ANN001
    proc = psutil.Process()
    baseline = proc.memory_info().rss
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.002):
            peak = max(peak, proc.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run()
    finally:
        done.set()
        sampler.join()
    peak = max(peak, proc.memory_info().rss)
    return max(peak - baseline, 0)
