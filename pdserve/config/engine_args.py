"""The engine flags shared by `pdserve generate`, `serve` and `launch`, named as in the seeds."""

from __future__ import annotations

import argparse

from pdserve.config.engine import EngineConfig, parse_size
from pdserve.config.fastdeploy_flags import first_port
from pdserve.spec_decode.config import speculative_config


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=d.dtype,
                   help="auto (bf16 on CUDA and on CPUs with AVX512_BF16 or AMX, else fp32), float32 (exact), "
                        "bfloat16, float16")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the KV cache (auto: the model's)")
    g.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when present)")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV cache block")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=d.enable_chunked_prefill,
                   help="cut long prompts into chunks that fit the step budget")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching, help="reuse KV blocks of shared prompt prefixes")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="fraction of device memory (CPU: of --kv-cache-memory or available RAM) to use")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="CPU: the memory the cache is sized from, e.g. 4G (default: available RAM)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="number of KV blocks; skips the profile run")
    g.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size)
    g.add_argument("--quantization", default=None,
                   help="w8a8: opt-in, not exact: int8 weights and dynamic int8 activations (CPU, fbgemm)")
    g.add_argument("--swap-space", type=float, default=d.swap_space,
                   help="GB of host memory for KV blocks evicted from the prefix cache; a later prefix hit there "
                        "is copied back instead of recomputed (0: off)")
    g.add_argument("--speculative-config", type=speculative_config, default=None,
                   help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'; each step speculates when measurement '
                        'says it pays at its batch size, or with "disable_by_batch_size": N always up to N sequences '
                        'and never above')
    g.add_argument("--startup-log", default=None, help="write the startup order (JSON lines) to this file")
    pd = p.add_argument_group("prefill/decode disaggregation")
    pd.add_argument("--splitwise-role", choices=["mixed", "prefill", "decode"], default=d.splitwise_role,
                    help="mixed: whole requests; prefill: prompts, KV sent to a decode instance; decode: the rest")
    pd.add_argument("--pd-comm-port", type=first_port, default=None,
                    help="control-plane port of a prefill/decode instance (default: a free port); FastDeploy's "
                         "per-rank list '9800,9801' is accepted, its first port used")
    pd.add_argument("--rdma-comm-ports", type=first_port, default=None,
                    help="the rdma transport's listen port (UCX's TCP listeners; default: UCX picks); FastDeploy's "
                         "per-rank list is accepted, its first port used")
    pd.add_argument("--cache-transfer-protocol", type=_protocols, default=d.cache_transfer_protocol,
                    help="KV transports in preference order, e.g. ipc,tcp (ipc: same host, tcp: any host, rdma: NIXL, "
                         "optional: pip install nixl-cu12==1.5.1)")
    pd.add_argument("--pd-transfer-timeout", type=float, default=d.pd_transfer_timeout,
                    help="seconds a decode instance holds blocks for KV that has not arrived")
    pd.add_argument("--splitwise-cache-buffer-size", type=float, default=d.splitwise_cache_buffer_size,
                    help="decode role: GB of host memory that prefill instances write the KV into; the decode "
                         "instance takes its own cache blocks only when the KV is complete (FastDeploy's flag)")


def _protocols(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def engine_config_from_args(args: argparse.Namespace, **extra: object) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, device=args.device,
        block_size=args.block_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory, num_gpu_blocks_override=args.num_gpu_blocks_override,
        tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
        splitwise_role=args.splitwise_role, pd_comm_port=args.pd_comm_port, rdma_comm_port=args.rdma_comm_ports,
        cache_transfer_protocol=args.cache_transfer_protocol, pd_transfer_timeout=args.pd_transfer_timeout,
        splitwise_cache_buffer_size=args.splitwise_cache_buffer_size, swap_space=args.swap_space,
        startup_log=args.startup_log, speculative_config=args.speculative_config, **extra)
