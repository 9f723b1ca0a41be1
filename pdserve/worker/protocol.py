"""Messages between the engine process and its workers: what a worker is told (WorkerInput) and answers
(WorkerMessage). All msgspec Structs encoded as msgpack: typed on both ends, no pickle on any socket.
"""

from __future__ import annotations

import msgspec

from pdserve.kv.layout import KVLayout
from pdserve.kv.transfer_plan import TransferPlan
from pdserve.sampling import SamplingParams


class TokenLogprobs(msgspec.Struct, array_like=True):
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None  # the token's rank among all (1 = the most likely); prompt logprobs carry it


# ---- engine -> worker ------------------------------------------------------------------------

class NewRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    output_token_ids: list[int] = []  # a decode instance starts from the prefill instance's first token
    num_resumed: int = 0  # the last num_resumed prompt tokens are output (AddRequest.num_resumed)


class Chunk(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]
    num_computed: int
    block_table: list[int]
    sample: bool  # this chunk reaches the request's last known token: sample the next one
    num_draft: int = 0  # the last num_draft tokens are speculative proposals, to verify (spec_decode)
    lora: str | None = None  # the LoRA adapter its tokens compute with (None: the base model)
    group_tables: list[list[int]] = []  # layer groups 1..'s block tables (config/layer_groups.py), 0: a block gone


DEVICE = "device"  # a BlockCopy's end that is the worker's own cache (the other ends are host segments' roles)


class BlockCopy(msgspec.Struct, array_like=True):
    """A cache in device memory (the worker's own): copy whole blocks between it and one of the cache
    service's host segments ("staging", "buffer", "host"), in the worker, before the step's forward pass."""

    copy_id: int
    src: str  # "device" or a host segment's role
    dst: str
    src_blocks: list[int]
    dst_blocks: list[int]


class ExecuteStep(msgspec.Struct, tag=True):
    new_requests: list[NewRequest]
    finished_ids: list[str]
    chunks: list[Chunk]
    transfers: list[TransferPlan] = []  # prefill role: KV to stream to decode instances, layer by layer
    copies: list[BlockCopy] = []  # run (and completed on the device's side) before the forward pass


class HostSegment(msgspec.Struct, array_like=True):
    """A segment of the cache's block layout that the cache service made for a worker whose cache is
    in device memory: the staging area P sends from and D receives into, the decode buffer, the host tier."""

    role: str  # "staging" | "buffer" | "host"
    name: str
    num_blocks: int


class CacheCommand(msgspec.Struct, tag=True):
    """After loading: create the KV cache, or attach to the one the cache service created."""

    create: bool
    segment: str | None = None
    messager_address: str | None = None  # prefill role: where to send StepTransfers / LayerDone
    private: bool = False  # create it in the worker's own (device) memory, not in a shared segment
    host_segments: list[HostSegment] = []  # private: the host memory the worker copies through
    num_blocks: int | None = None  # fewer blocks than this rank profiled: the smallest rank's; staging's room


class LoRACommand(msgspec.Struct, tag=True):
    """Read an adapter into the worker's host copies ("load"), or drop it ("unload")."""

    action: str
    name: str
    path: str = ""


class WorkerShutdown(msgspec.Struct, tag=True):
    pass


class CalibrateCommand(msgspec.Struct, tag=True):
    """Time these step shapes (admission/calibration.py): (streams decoding, prompt tokens) each."""

    steps: list[tuple[int, int]]
    context: int  # tokens of context of each decoding stream
    repeats: int


class Calibration(msgspec.Struct, tag=True):
    seconds: list[float]  # per step of the command, the fastest of its timed repeats


class WeightsCommand(msgspec.Struct, tag=True):
    """Free the weights and the KV cache ("clear"), or load both again from disk ("load")."""

    action: str
    segment: str | None = None  # "load", a rank after the first: the cache segment rank 0 created again


WorkerInput = ExecuteStep | WeightsCommand | LoRACommand | CacheCommand | CalibrateCommand | WorkerShutdown


# ---- worker -> engine ------------------------------------------------------------------------

class Sampled(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]  # one, or with speculation the accepted proposals and the token after them
    logprobs: list[TokenLogprobs] | None = None  # one per token
    error: str | None = None  # the request cannot go on (its output constraint failed): the engine ends it


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Log probabilities of prompt tokens first_position .. first_position + len(entries) - 1."""

    request_id: str
    first_position: int
    entries: list[TokenLogprobs]


class StepResult(msgspec.Struct, tag=True):
    sampled: list[Sampled]
    prompt_logprobs: list[PromptLogprobs] = []
    copies_done: list[int] = []  # the step's BlockCopy ids, complete


class WorkerLoaded(msgspec.Struct, tag=True):
    """Weights are loaded and the block count is known (profiled or given); no cache exists yet."""

    layout: KVLayout
    max_model_len: int
    vocab_size: int
    profile: dict
    weights_resident: int = 0  # bytes the process's resident set grew by while it loaded the weights


class WorkerReady(msgspec.Struct, tag=True):
    num_blocks: int
    max_model_len: int
    vocab_size: int
    kv_cache_name: str | None  # shared-memory segment holding the cache (CPU), None on CUDA
    profile: dict  # what the profile run measured (empty when the block count was given)


class WorkerError(msgspec.Struct, tag=True):
    error: str


class WorkerOk(msgspec.Struct, tag=True):
    kv_cache_name: str | None = None  # after loading weights again: the (new) cache segment


WorkerMessage = StepResult | WorkerLoaded | WorkerReady | WorkerError | WorkerOk | Calibration
