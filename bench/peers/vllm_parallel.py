"""Runs under vLLM's own Python: bench/parallel.py's three figures for vLLM at a TP size, one JSON line."""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    folder, tp, work_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    work = json.load(open(work_file))
    from vllm import LLM, SamplingParams, TokensPrompt

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    llm = LLM(model=folder, dtype="bfloat16", max_model_len=2048, enable_prefix_caching=False,
              tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in work["throughput"][:4]], params(8), use_tqdm=False)
    n = 128
    t = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=work["decode"][0])], params(1), use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=work["decode"][0])], params(n), use_tqdm=False)
    tpot = (time.perf_counter() - t - first) / (n - 1) * 1000
    t = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=work["prefill"][0])], params(1), use_tqdm=False)
    prefill = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in work["throughput"]],
                        [params(m) for _, m in work["throughput"]], use_tqdm=False)
    elapsed = time.perf_counter() - t
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"tpot_ms": tpot, "prefill_ms": prefill, "tok_s": generated / elapsed}), flush=True)


if __name__ == "__main__":
    main()
