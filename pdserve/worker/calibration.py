"""The worker's side of admission's calibration (admission/calibration.py): real forward passes of the step
shapes the engine asks for, over the cache that nobody uses yet, timed.

The blocks written are free at startup: no request, prefix index or transfer refers to them, and nothing is
announced to a peer (no layer callback), so the run leaves no trace but warm kernels."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pdserve.model import SequenceChunk
from pdserve.worker.model_runner import ModelRunner
from pdserve.worker.protocol import CalibrateCommand, Calibration

TOKEN = 1  # any id: a step's cost does not depend on which tokens it computes


def time_steps(runner: ModelRunner, command: CalibrateCommand, first_rank: bool,
               run: Callable[[Callable[[], object]], object] | None = None) -> Calibration:
    """Per step, the fastest of `repeats` timed runs after an untimed one (a run that met another process on
    its cores says nothing of the instance). Every tensor-parallel rank runs the same steps (they meet in the
    all-reduces); the first rank's times are the instance's. `run` wraps each timed run (the core loan's)."""
    run = run or (lambda step: step())
    seconds = []
    for decodes, prompt_tokens in command.steps:
        chunks = step_chunks(decodes, prompt_tokens, command.context, runner.block_size, _num_groups(runner))
        forward: Callable[[], object] = ((lambda c=chunks: runner.logits(c)) if first_rank
                                         else (lambda c=chunks: runner.forward_only(c)))
        times = [run(lambda f=forward: _timed(f, runner.device)) for _ in range(command.repeats + 1)][1:]
        seconds.append(min(times))
    return Calibration(seconds)


def step_chunks(decodes: int, prompt_tokens: int, context: int, block_size: int, groups: int = 1
                ) -> list[SequenceChunk]:
    """`decodes` streams each one token past `context - 1` cached ones, and a prompt chunk computed from
    scratch, each on blocks of its own from block 0 on. With layer groups every group reads the same table (a
    sliding group's attention reads its window of it, as it would its own)."""
    per_stream = -(-context // block_size)

    def chunk(tokens: list[int], done: int, table: list[int]) -> SequenceChunk:
        return SequenceChunk(tokens, done, table, group_tables=[table] * (groups - 1))

    chunks = [chunk([TOKEN], context - 1, list(range(i * per_stream, (i + 1) * per_stream))) for i in range(decodes)]
    if prompt_tokens:
        first = decodes * per_stream
        chunks.append(chunk([TOKEN] * prompt_tokens, 0, list(range(first, first + -(-prompt_tokens // block_size)))))
    return chunks


def _num_groups(runner: ModelRunner) -> int:
    groups = runner.kv_cache.layout.layer_groups if runner.kv_cache is not None else None
    return 1 if groups is None else groups.num_groups


def _timed(forward: Callable[[], object], device: torch.device) -> float:
    start = time.perf_counter()
    forward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
