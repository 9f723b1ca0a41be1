"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

from pdserve.loader.errors import ModelLoadError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when present)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per KV cache block")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="LLM serving with prefill/decode disaggregation")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt and print it as it comes")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
    except (ModelLoadError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pdserve.model_runner import ModelRunner
    from pdserve.sampling import SamplingParams
    from pdserve.tokenizer import Tokenizer

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens)
    runner = ModelRunner(args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                         max_model_len=args.max_model_len)
    tokenizer = Tokenizer(runner.folder)
    if args.chat:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=True)
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    printed = ""
    for text in _stream_text(runner, tokenizer, prompt_ids, params):
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text
    sys.stdout.write("\n")
    return 0


def _stream_text(runner, tokenizer, prompt_ids: list[int], params) -> Iterator[str]:  # noqa: ANN001
    """One request, generated step by step on a private run of KV blocks; yields the text so far."""
    from pdserve.model import SequenceChunk
    from pdserve.sampling import SamplingRow, check_stop, make_generator

    total = len(prompt_ids) + (params.max_tokens or runner.max_model_len)
    if len(prompt_ids) >= runner.max_model_len:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens; the model allows {runner.max_model_len}")
    total = min(total, runner.max_model_len)
    num_blocks = -(-total // runner.block_size)
    runner.allocate_kv_cache(num_blocks)
    table = list(range(num_blocks))
    eos = tuple(set(runner.config.eos_token_ids) | set(tokenizer.eos_token_ids))
    row = SamplingRow(params, prompt_ids, [], eos, make_generator(params.seed, runner.device))
    chunk = SequenceChunk(list(prompt_ids), 0, table)
    while True:
        token = int(runner.execute([chunk], [row]).token_ids[0])
        row.output_token_ids.append(token)
        done = len(prompt_ids) + len(row.output_token_ids)
        finish = check_stop(params, row.output_token_ids, eos, runner.max_model_len - done)
        yield tokenizer.decode(row.output_token_ids, skip_special_tokens=params.skip_special_tokens)
        if finish:
            return
        chunk = SequenceChunk([token], done - 1, table)


if __name__ == "__main__":
    sys.exit(main())
