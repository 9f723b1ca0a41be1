"""Runs under vLLM's own Python (its CPU build pins other versions than pdserve): the throughput
workload of bench/throughput.py, printed as one JSON line. Called by bench/throughput.py --vllm-python."""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    folder, requests, prompt_len, new_tokens = sys.argv[1], *map(int, sys.argv[2:5])
    dtype = sys.argv[5] if len(sys.argv) > 5 else "float32"
    import torch
    from vllm import LLM, SamplingParams, TokensPrompt

    g = torch.Generator().manual_seed(0)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(100, 49152, (prompt_len,), generator=g).tolist())
               for _ in range(requests)]
    llm = LLM(model=folder, dtype=dtype, max_model_len=1024, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    print(json.dumps({"tokens_per_s": requests * new_tokens / elapsed}), flush=True)


if __name__ == "__main__":
    main()
