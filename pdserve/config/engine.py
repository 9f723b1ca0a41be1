"""EngineConfig: every flag an instance's engine and workers need, in one msgspec Struct.

It travels to child processes as msgpack on their command line, so no pickle is involved.
"""

from __future__ import annotations

import base64

import msgspec

from pdserve.spec_decode.config import SpeculativeConfig, speculative_config


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    model: str | None = None  # None: the embedded default model
    dtype: str = "auto"  # bf16 on CUDA and on CPUs with native bf16 dot products, fp32 elsewhere
    kv_cache_dtype: str = "auto"  # auto: the model's dtype
    device: str | None = None
    block_size: int = 64
    max_model_len: int | None = None  # None: the model's own limit
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes; CPU: the "device memory" the cache is sized from
    num_gpu_blocks_override: int | None = None
    tensor_parallel_size: int = 1
    quantization: str | None = None  # "w8a8": opt-in int8 weights + dynamic int8 activations (CPU)
    splitwise_role: str = "mixed"  # mixed | prefill | decode
    pd_comm_port: int | None = None  # control plane (ZMQ); None: a free port, reported at startup
    rdma_comm_port: int | None = None  # the rdma transport's UCX TCP listeners (None: UCX picks)
    pd_host: str = "127.0.0.1"  # the address the control plane and the KV receiver listen on
    advertise_host: str | None = None  # the address peers are told to use (default: pd_host)
    cache_transfer_protocol: tuple[str, ...] = ("ipc", "tcp")  # in preference order
    pd_transfer_timeout: float = 30.0  # seconds D holds blocks for KV that has not arrived
    splitwise_cache_buffer_size: float = 0.0  # GB of host buffer D receives P's KV into (decode only; 0: none)
    swap_space: float = 0.0  # GB of host memory for the prefix cache's evicted blocks (0: no host tier)
    startup_timeout: float = 600.0
    startup_log: str | None = None  # JSON-lines file recording the startup order
    speculative_config: SpeculativeConfig | None = None  # n-gram speculative decoding (vLLM's JSON)

    def __post_init__(self) -> None:
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            msgspec.structs.force_setattr(self, "speculative_config", speculative_config(self.speculative_config))
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("--num-gpu-blocks-override must be at least 1")
        if self.quantization not in (None, "w8a8"):
            raise ValueError(f"--quantization must be w8a8 (or unset), got {self.quantization!r}")
        if self.splitwise_role not in ("mixed", "prefill", "decode"):
            raise ValueError(f"--splitwise-role must be mixed, prefill or decode, got {self.splitwise_role!r}")
        unknown = [p for p in self.cache_transfer_protocol if p not in ("ipc", "tcp", "rdma")]
        if unknown or not self.cache_transfer_protocol:
            raise ValueError(f"--cache-transfer-protocol takes a list of ipc, tcp and rdma, got "
                             f"{','.join(self.cache_transfer_protocol)!r}")
        if "rdma" in self.cache_transfer_protocol and self.splitwise_role != "mixed":
            from pdserve.transport import RDMA_INSTALL, rdma_available

            if not rdma_available():
                raise ValueError(f"--cache-transfer-protocol rdma needs NIXL, which is not installed: {RDMA_INSTALL}")
        if self.splitwise_cache_buffer_size < 0:
            raise ValueError("--splitwise-cache-buffer-size must be at least 0 (GB)")
        if self.splitwise_cache_buffer_size and self.splitwise_role != "decode":
            raise ValueError(f"--splitwise-cache-buffer-size is for decode instances (--splitwise-role decode); "
                             f"this one is {self.splitwise_role}")
        if self.swap_space < 0:
            raise ValueError("--swap-space must be at least 0 (GB)")
        if self.swap_space and not self.enable_prefix_caching:
            raise ValueError("--swap-space keeps blocks evicted from the prefix cache; it needs "
                             "--enable-prefix-caching")
        if self.pd_transfer_timeout <= 0:
            raise ValueError("--pd-transfer-timeout must be positive")
        if self.tensor_parallel_size != 1:
            raise ValueError("--tensor-parallel-size > 1 is not supported yet")

    def encode(self) -> str:
        return base64.b64encode(msgspec.msgpack.encode(self)).decode()

    @classmethod
    def decode(cls, text: str) -> EngineConfig:
        return msgspec.msgpack.decode(base64.b64decode(text), type=cls)


def parse_size(text: str) -> int:
    """'4G', '512M', '1.5GiB', '1000000' -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t))
