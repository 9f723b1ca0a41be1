"""EngineConfig: every setting an instance's engine and workers need, declared once.

Each field declared with `option` is also a flag of `pdserve generate`, `serve` and `launch` (named as
in the seeds; config/flags.py generates the parser). The config travels to child processes as msgpack
on their command line, so no pickle is involved.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import msgspec

from pdserve.config.fastdeploy_flags import first_port, per_rank_ports
from pdserve.config.flags import option
from pdserve.config.kv_events import KVEventsConfig, kv_events_config
from pdserve.config.lora import LoRAModule, as_lora_module, lora_module
from pdserve.config.quantization import QUANTIZATION_CHOICES
from pdserve.config.roles import Role
from pdserve.config.speculative import SpeculativeConfig, speculative_config
from pdserve.utils.dtype_names import KV_CACHE_DTYPE_CHOICES

ENGINE, PD, LORA = "engine", "prefill/decode disaggregation", "LoRA adapters"


def parse_size(text: str) -> int:
    """'4G', '512M', '1.5GiB', '1000000' -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t))


def protocol_list(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str | None = option(
        None, "Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)", group=ENGINE)
    dtype: str = option("auto", "auto (bf16 on CUDA and on CPUs with AVX512_BF16 or AMX, else fp32), float32 (exact), "
                        "bfloat16, float16", group=ENGINE)
    kv_cache_dtype: str = option("auto", "dtype of the KV cache (auto: the model's); fp8 (= fp8_e4m3), fp8_e5m2 and "
                                 "int8 store K/V in 8 bits with a bf16 scale per token and KV head",
                                 choices=KV_CACHE_DTYPE_CHOICES, group=ENGINE)
    device: str | None = option(None, "cpu or cuda[:N] (default: cuda when present)", group=ENGINE)
    block_size: int = option(64, "tokens per KV cache block", group=ENGINE)
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's)", group=ENGINE)
    max_num_seqs: int = option(64, "most requests running at once", group=ENGINE)
    max_num_batched_tokens: int = option(2048, "token budget of one step", group=ENGINE)
    enable_chunked_prefill: bool = option(True, "cut long prompts into chunks that fit the step budget", group=ENGINE)
    scheduling_policy: str = option(
        "fcfs", "order of the waiting queue: fcfs (arrival), or priority (the request's `priority` field, lower "
        "first, then arrival; preemption takes the lowest priority first)", choices=["fcfs", "priority"],
        group=ENGINE)
    enable_prefix_caching: bool = option(True, "reuse KV blocks of shared prompt prefixes", group=ENGINE)
    gpu_memory_utilization: float = option(
        0.9, "fraction of device memory (CPU: of --kv-cache-memory or available RAM) to use", group=ENGINE)
    kv_cache_memory: int | None = option(  # bytes; CPU: the "device memory" the cache is sized from
        None, "CPU: the memory the cache is sized from, e.g. 4G (default: available RAM)", type=parse_size,
        group=ENGINE)
    calibrate_load: bool = option(
        False, "before ready, time a few decode and prompt steps so that admission by SLO judges the first request "
        "on measurements (on whenever --ttft-slo-ms or --tpot-slo-ms is given; pdserve launch sets it on its "
        "instances when its routers admit by SLO)", group=ENGINE, switch=True)
    num_gpu_blocks_override: int | None = option(None, "number of KV blocks; skips the profile run", group=ENGINE)
    tensor_parallel_size: int = option(
        1, "worker ranks of one instance, each with its share of the attention heads, KV heads and MLP columns "
        "(CPU: each on its own share of the instance's cores; CUDA: one GPU each)", group=ENGINE, aliases=("-tp",))
    quantization: str | None = option(  # default: gguf for a .gguf file, none for a Hugging Face folder
        None, "weights to compute with: gguf (a .gguf file's own block formats, packed; its default), none "
        "(dequantized to --dtype, exact; a folder's default), q8_0 / q4_0 (a Hugging Face folder quantized at load), "
        "w8a8 (int8 weights and dynamic int8 activations, fbgemm)", group=ENGINE)
    swap_space: float = option(  # GB of host memory for the prefix cache's evicted blocks
        0.0, "GB of host memory for KV blocks evicted from the prefix cache; a later prefix hit there is copied "
        "back instead of recomputed (0: off)", group=ENGINE)
    kv_disk_path: str | None = option(
        None, "a folder for a disk tier under the host tier (needs --swap-space): blocks saved to host memory are "
        "written there too and read back on a later prefix hit; an instance restarted on the same folder with the "
        "same weights, dtype and layout finds them again (others never read them)", group=ENGINE)
    kv_disk_size: int = option(  # bytes
        20 * 2**30, "the disk tier's size, e.g. 20G; least recently used blocks go first", type=parse_size,
        group=ENGINE)
    enable_kv_pull: bool = option(
        False, "prefix pulls between instances (needs --swap-space): serve this instance's host-tier blocks to "
        "peers, and pull a prompt's prefix from the peer a router names (the one whose KV events show a longer "
        "prefix) when the pull is cheaper than computing it", switch=True, group=ENGINE)
    speculative_config: SpeculativeConfig | None = option(
        None, 'speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'; each step speculates when measurement says it pays at '
        'its batch size, or with "disable_by_batch_size": N always up to N sequences and never above',
        type=speculative_config, group=ENGINE)
    kv_events_config: KVEventsConfig | None = option(
        None, 'publish the prefix cache\'s changes (KV events), vLLM\'s JSON: \'{"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' (default: on free '
        'ports when the instance registers with a router; "publisher": "null" turns them off)',
        type=kv_events_config, group=ENGINE)
    disable_hybrid_kv_cache_manager: bool = option(
        False, "one block table for every layer also for a model with sliding-window layers (which then keep every "
        "block); by default its layers are grouped by window and a sliding group gives back the blocks that leave "
        "its window", group=ENGINE)
    startup_log: str | None = option(None, "write the startup order (JSON lines) to this file", group=ENGINE)
    enable_lora: bool = option(False, "serve LoRA adapters: a request names one in its `model` field",
                               switch=True, group=LORA)
    lora_modules: tuple[LoRAModule, ...] = option(
        (), "adapters to serve, PEFT folders: NAME=PATH ... or vLLM's JSON '{\"name\": ..., \"path\": ..., "
        "\"base_model_name\": ...}'", type=lora_module, nargs="+", group=LORA)
    max_loras: int = option(1, "adapters in one step (on the device at once); others wait or rotate in",
                            group=LORA)
    max_lora_rank: int = option(16, "the largest adapter rank served", group=LORA)
    enable_lora_runtime_loading: bool = option(
        False, "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", switch=True, group=LORA)
    startup_timeout: float = 600.0

    splitwise_role: Role = option(
        Role.MIXED, "mixed: whole requests; prefill: prompts, KV sent to a decode instance; decode: the rest",
        group=PD)
    pd_comm_port: int | None = option(  # control plane (ZMQ); None: a free port, reported at startup
        None, "control-plane port of a prefill/decode instance (default: a free port); FastDeploy's per-rank list "
        "'9800,9801' gives each data-parallel rank its own", type=per_rank_ports, group=PD)
    rdma_comm_port: int | None = option(  # the rdma transport's UCX TCP listeners (None: UCX picks)
        None, "the rdma transport's listen port (UCX's TCP listeners; default: UCX picks); FastDeploy's per-rank "
        "list is accepted, its first port used", flag="--rdma-comm-ports", type=first_port, group=PD)
    cache_transfer_protocol: tuple[str, ...] = option(
        ("ipc", "tcp"), "KV transports in preference order, e.g. ipc,tcp (ipc: same host, tcp: any host, rdma: "
        "NIXL, optional: pip install nixl-cu12==1.5.1)", type=protocol_list, group=PD)
    pd_transfer_timeout: float = option(
        30.0, "seconds a decode instance holds blocks for KV that has not arrived", group=PD)
    splitwise_cache_buffer_size: float = option(
        0.0, "decode role: GB of host memory that prefill instances write the KV into; the decode instance takes "
        "its own cache blocks only when the KV is complete (FastDeploy's flag)", group=PD)
    enable_role_switch: bool = option(
        False, "the instance can change role in place (POST /role, the planner's lever): it starts with what "
        "both PD sides need (the cache service owns the cache, with receivers and the cache messager); a mixed "
        "one also takes the decode side of a PD request", switch=True, group=PD)
    pd_host: str = "127.0.0.1"  # the address the control plane and the KV receiver listen on (serve's --host)
    advertise_host: str | None = None  # the address peers are told to use (default: pd_host)
    data_parallel_rank: int | None = None  # this engine's rank among the server's data-parallel ones

    def __post_init__(self) -> None:
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            object.__setattr__(self, "speculative_config", speculative_config(self.speculative_config))
        if self.kv_events_config is not None and not isinstance(self.kv_events_config, KVEventsConfig):
            object.__setattr__(self, "kv_events_config", kv_events_config(self.kv_events_config))
        try:
            object.__setattr__(self, "splitwise_role", Role(self.splitwise_role))
        except ValueError:
            raise ValueError(f"--splitwise-role must be mixed, prefill or decode, got {self.splitwise_role!r}") \
                from None
        object.__setattr__(self, "cache_transfer_protocol", tuple(self.cache_transfer_protocol))
        object.__setattr__(self, "lora_modules", tuple(map(as_lora_module, self.lora_modules)))
        self._check()
        self._check_lora()

    @property
    def has_pd_parts(self) -> bool:
        """Started with what a PD side needs (the cache service owns the cache, with receivers and the messager):
        a prefill or decode instance, or one that may switch role."""
        return self.splitwise_role != Role.MIXED or self.enable_role_switch

    def one_block_table_reason(self) -> str | None:
        """Why this instance keeps one block table for every layer even for a model with sliding-window layers
        (config/layer_groups.py); None: it groups them."""
        if self.disable_hybrid_kv_cache_manager:
            return "--disable-hybrid-kv-cache-manager"
        return None

    def _check(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("--num-gpu-blocks-override must be at least 1")
        if self.quantization not in (None, *QUANTIZATION_CHOICES):
            raise ValueError(f"--quantization takes {', '.join(QUANTIZATION_CHOICES)}, got {self.quantization!r}")
        unknown = [p for p in self.cache_transfer_protocol if p not in ("ipc", "tcp", "rdma")]
        if unknown or not self.cache_transfer_protocol:
            raise ValueError(f"--cache-transfer-protocol takes a list of ipc, tcp and rdma, got "
                             f"{','.join(self.cache_transfer_protocol)!r}")
        if "rdma" in self.cache_transfer_protocol and self.splitwise_role != Role.MIXED:
            from pdserve.transport import RDMA_INSTALL, rdma_available

            if not rdma_available():
                raise ValueError(f"--cache-transfer-protocol rdma needs NIXL, which is not installed: {RDMA_INSTALL}")
        if self.splitwise_cache_buffer_size < 0:
            raise ValueError("--splitwise-cache-buffer-size must be at least 0 (GB)")
        if self.splitwise_cache_buffer_size and self.splitwise_role != Role.DECODE:
            raise ValueError(f"--splitwise-cache-buffer-size is for decode instances (--splitwise-role decode); "
                             f"this one is {self.splitwise_role}")
        if self.enable_role_switch and self.splitwise_cache_buffer_size:
            raise ValueError("--enable-role-switch with --splitwise-cache-buffer-size is not served (the decode "
                             "buffer is a decode-only segment)")
        if self.enable_role_switch and "rdma" in self.cache_transfer_protocol:
            raise ValueError("--enable-role-switch with the rdma transport is not served yet (its receivers are "
                             "registered once, for the role the instance starts in)")
        if self.swap_space < 0:
            raise ValueError("--swap-space must be at least 0 (GB)")
        if self.swap_space and not self.enable_prefix_caching:
            raise ValueError("--swap-space keeps blocks evicted from the prefix cache; it needs "
                             "--enable-prefix-caching")
        if self.kv_disk_path is not None and not self.swap_space:
            raise ValueError("--kv-disk-path writes and reads KV blocks through the host tier: it needs --swap-space")
        if self.enable_kv_pull and not self.swap_space:
            raise ValueError("--enable-kv-pull serves and receives KV blocks through the host tier: it needs "
                             "--swap-space")
        if self.enable_kv_pull and self.tensor_parallel_size > 1:
            raise ValueError("--enable-kv-pull with --tensor-parallel-size above 1 is not served yet (each rank "
                             "holds its share of a block)")
        if self.kv_disk_size <= 0:
            raise ValueError("--kv-disk-size must be positive")
        if self.pd_transfer_timeout <= 0:
            raise ValueError("--pd-transfer-timeout must be positive")
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be at least 1")

    def _check_lora(self) -> None:
        if not self.enable_lora:
            if self.lora_modules or self.enable_lora_runtime_loading:
                raise ValueError("--lora-modules and --enable-lora-runtime-loading need --enable-lora")
            return
        if self.max_loras < 1:
            raise ValueError("--max-loras must be at least 1")
        if self.max_lora_rank < 1:
            raise ValueError("--max-lora-rank must be at least 1")
        if self.tensor_parallel_size > 1:
            raise ValueError("--enable-lora with --tensor-parallel-size above 1 is not served yet")
        names = [m.name for m in self.lora_modules]
        twice = sorted(n for n in names if names.count(n) > 1)
        if twice:
            raise ValueError(f"--lora-modules names the adapter {twice[0]!r} twice")

    def encode(self) -> str:
        return base64.b64encode(msgspec.msgpack.encode(self)).decode()

    @classmethod
    def decode(cls, text: str) -> EngineConfig:
        return msgspec.msgpack.decode(base64.b64decode(text), type=cls)
