"""Ask a PD deployment (`make demo`, `pdserve launch` or pd_two_hosts.sh) a question with the openai client,
streaming the answer and printing where the time to first token went."""

from __future__ import annotations

import argparse

import httpx
import openai


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--prompt", default="Explain in two sentences why the sky is blue.")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": args.prompt}]
    for chunk in client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                                max_tokens=96, stream=True):
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()
    # pdserve's per-request timings (server clock): how the time to first token splits up
    r = httpx.post(f"{args.url}/v1/chat/completions", timeout=120,
                   json={"messages": messages, "max_tokens": 8, "collect_metrics": True}).json()
    m = r["metrics"]
    steps = [("queued on decode", "arrival", "preallocated"),
             ("cache info to prefill", "preallocated", "cache_info_sent"),
             ("prefill + KV stream", "cache_info_sent", "last_layer_written"),
             ("prefill done to decode", "last_layer_written", "prefill_done_received"),
             ("decode of the rest", "prefill_done_received", "finished")]
    for name, a, b in steps:
        if a in m and b in m:
            print(f"{name:>24}: {1000 * (m[b] - m[a]):8.1f} ms")


if __name__ == "__main__":
    main()
