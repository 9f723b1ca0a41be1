"""Runs under vLLM's own Python: bench/forward.py's single-sequence workload (prefill of one prompt,
steady batch-1 decode) for one dtype, printed as one JSON line. Called by bench/forward.py --vllm-python."""

from __future__ import annotations

import json
import statistics
import sys
import time


def main() -> None:
    folder, prompt_len, new_tokens, reps, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
        sys.argv[5]
    import torch
    from vllm import LLM, SamplingParams, TokensPrompt

    g = torch.Generator().manual_seed(0)
    prompt = TokensPrompt(prompt_token_ids=torch.randint(100, 49152, (prompt_len,), generator=g).tolist())
    llm = LLM(model=folder, dtype=dtype, max_model_len=2048, enable_prefix_caching=False)

    def seconds(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - t

    seconds(4)  # warm-up
    prefill, decode = [], []
    for _ in range(reps):
        t_one, t_many = seconds(1), seconds(1 + new_tokens)
        prefill.append(prompt_len / t_one)
        decode.append(new_tokens / (t_many - t_one))
    print(json.dumps({"prefill": prefill, "decode": decode, "median": [statistics.median(prefill),
                                                                          statistics.median(decode)]}), flush=True)


if __name__ == "__main__":
    main()
