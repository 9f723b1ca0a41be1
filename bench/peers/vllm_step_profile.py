"""Runs under vLLM's own Python (its engine in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0): bench/step_profile.py's
shapes as vLLM's engine runs them, each step's time and one profiled run split by op class (bench/profile_classes.py),
printed as one JSON line. Ops inside torch.compile's fused kernels are not seen one by one: they count as between
ops, and its op times add up to more than the wall time (they are printed as shares of the op time). Called by
bench/step_profile.py --vllm-python."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from profile_classes import CLASSES, classify  # noqa: E402


def main() -> None:
    folder, spec = sys.argv[1], json.loads(sys.argv[2])
    import torch
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=folder, dtype=spec["dtype"], max_model_len=2048, max_num_seqs=64, enable_prefix_caching=True)
    g = torch.Generator().manual_seed(0)
    new_tokens, repeats = 48, 3

    def prompts(batch: int, length: int) -> list:
        return [TokensPrompt(prompt_token_ids=torch.randint(100, 49152, (length,), generator=g).tolist())
                for _ in range(batch)]

    def run(ps: list, n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(ps, params, use_tqdm=False)
        return time.perf_counter() - t

    rows = []
    for batch, context in spec["decodes"]:
        ps = prompts(batch, context)
        run(ps, 2)
        steps = statistics.median((run(ps, 1 + new_tokens) - run(ps, 1)) / new_tokens for _ in range(repeats))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run(ps, 1 + new_tokens)
        classes: dict[str, float] = defaultdict(float)
        for event in prof.events():
            if not event.is_user_annotation:
                classes[classify(event.name)] += event.self_cpu_time_total / 1e3 / (1 + new_tokens)
        seen = sum(classes.values()) or 1.0  # its profiler's op times add up to more than the wall time: shares
        rows.append({"shape": f"decode {batch} x {context}", "engine_ms": 1e3 * steps,
                     "classes": {k: 100 * classes.get(k, 0.0) / seen for k in CLASSES}})
    fresh = [prompts(1, spec["prefill"]) for _ in range(3)]
    rows.append({"shape": f"prefill {spec['prefill']}", "engine_ms": 1e3 * statistics.median(run(p, 1) for p in fresh)})
    print(json.dumps({"rows": rows}), flush=True)


if __name__ == "__main__":
    main()
