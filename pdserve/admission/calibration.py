"""Admission judged from the first request: the step shapes an engine times before it says it is ready.

A fresh engine has no step timings, and a predictor with none would let the first burst through unjudged (the
one that matters after a deploy or a restart). So before ready, the engine has its worker time a few real
forward passes over its own (still empty) KV cache, with the instance's dtype, cores and ranks: decode steps of
several batch sizes, prompt chunks up to the step budget (a fit from small steps alone made big steps look cheap),
and a step that carries both. Their (streams, prompt tokens, seconds) seed the load tracker's step-cost fit, which
real steps then take over. Torch-free: the plan here, the timing in worker/calibration.py.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTEXT = 256  # tokens of context each decoding stream has: a short chat's
REPEATS = 2  # each shape timed this many times after one untimed run (oneDNN makes its kernels on first use); the
            # fastest counts
MAX_CHUNK = 1024  # prompt tokens of the largest timed chunk: a prompt token's cost is flat from here on, and
                  # the whole calibration stays near a second on 2 cores


@dataclass(frozen=True)
class CalibrationStep:
    decodes: int  # streams decoding one token each, each over CONTEXT tokens of context
    prompt_tokens: int  # prompt tokens computed from scratch in the same step


def calibration_plan(max_num_seqs: int, max_num_batched_tokens: int, num_blocks: int, block_size: int,
                     max_model_len: int) -> list[CalibrationStep]:
    """Decode batches 1 .. max_num_seqs (powers of 4 and the limit), prompt chunks of a quarter and all of the
    step budget (at most MAX_CHUNK), and a middle batch with the small chunk; only what the empty cache holds."""
    context = min(CONTEXT, max_model_len - 1)
    blocks_per_stream = -(-context // block_size)
    batches = sorted({b for b in (1, 4, 16, 64) if b < max_num_seqs} | {max_num_seqs})
    budget = min(max_num_batched_tokens, max_model_len, MAX_CHUNK)
    chunks = sorted({max(1, budget // 4), budget})
    steps = [CalibrationStep(b, 0) for b in batches] + [CalibrationStep(0, n) for n in chunks]
    steps.append(CalibrationStep(batches[len(batches) // 2], chunks[0]))
    return [s for s in steps if s.decodes * blocks_per_stream + -(-s.prompt_tokens // block_size) <= num_blocks
            and s.decodes + s.prompt_tokens <= max_num_batched_tokens]
