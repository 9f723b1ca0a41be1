"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from pdserve.config.engine_args import add_engine_args, engine_config_from_args
from pdserve.config.errors import ModelLoadError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="LLM serving with prefill/decode disaggregation")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts offline, through the engine")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)

    srv = sub.add_parser("serve", help="serve the OpenAI API (one instance)")
    add_engine_args(srv)
    from pdserve.api.settings import ServerSettings
    from pdserve.config.fastdeploy_flags import add_fastdeploy_args
    from pdserve.config.flags import add_flags

    add_flags(srv, ServerSettings)
    add_fastdeploy_args(srv)

    rtr = sub.add_parser("router", help="route OpenAI requests to prefill/decode pairs (instances register)")
    from pdserve.router.settings import RouterSettings

    add_flags(rtr, RouterSettings)

    lch = sub.add_parser("launch", help="start a router and prefill/decode (and mixed) instances as one deployment")
    from pdserve.deploy.launch import add_launch_args

    add_launch_args(lch)
    pln = sub.add_parser("planner", help="move capacity between prefill and decode as the load changes (changes "
                         "roles of instances started with --enable-role-switch); `planner profile` saves a profile")
    from pdserve.planner.serve import add_planner_args

    add_planner_args(pln)
    top = sub.add_parser("top", help="a deployment's live view: every member's role, load, queue, KV use, TTFT/ITL")
    from pdserve.top.serve import add_top_args

    add_top_args(top)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser("serve", help="measure a running server (or router): the seed 003 table")
    from pdserve.bench_serve.args import add_bench_args

    add_bench_args(bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "launch":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.instance_args = rest
    from pdserve.engine.engine_client import EngineError

    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            from pdserve.api.serve import serve

            return serve(args)
        if args.command == "router":
            from pdserve.router.serve import serve_router

            return serve_router(args)
        if args.command == "launch":
            from pdserve.deploy.launch import launch, launch_settings

            settings = launch_settings(args)
            if settings.ray is not None:
                from pdserve.deploy.ray_launch import launch_on_ray

                return launch_on_ray(args, settings)
            return launch(args, settings)
        if args.command == "planner":
            from pdserve.planner.serve import planner_main

            return planner_main(args)
        if args.command == "top":
            from pdserve.top.serve import top_main

            return top_main(args)
        if args.command == "bench":
            from pdserve.bench_serve.run import bench_serve

            return bench_serve(args)
    except (ModelLoadError, ValueError, EngineError, OSError) as e:
        for line in str(e).splitlines() or [type(e).__name__]:
            print(f"pdserve: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _stopped(args.command, "SIGINT")
        return EXIT_SIGINT
    except SystemExit as e:  # SIGTERM, as exit_on_sigterm turns it into
        if e.code == EXIT_SIGTERM:
            _stopped(args.command, "SIGTERM")
        raise
    return 0


# Exit codes (docs/operations in README): 0 stopped by itself, 1 its engine died (restart it), 2 a
# bad flag, model or port (do not), 130 SIGINT (Ctrl-C), 143 SIGTERM.
EXIT_SIGINT, EXIT_SIGTERM = 130, 143


def _stopped(command: str, signal_name: str) -> None:
    print(f"pdserve {command}: stopped ({signal_name})", file=sys.stderr, flush=True)


def _generate(args: argparse.Namespace) -> int:
    from pdserve.offline.llm import LLM
    from pdserve.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens)
    config = engine_config_from_args(args)
    with LLM(**dataclasses.asdict(config)) as llm:
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outs = llm.generate(args.prompt, params)
    for i, out in enumerate(outs):
        if len(outs) > 1:
            print(f"--- prompt {i}")
        print(out.outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
