"""Messages between the frontend (LLM / API server), the engine process and the workers.

All msgspec Structs encoded as msgpack: typed on both ends, no pickle on any socket.
"""

from __future__ import annotations

import msgspec

from pdserve.sampling import SamplingParams

# ---- frontend -> engine ----------------------------------------------------------------------

class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True):
    """A synchronous call answered by a UtilityResult with the same call_id (stats, debug checks)."""

    call_id: int
    method: str


class Shutdown(msgspec.Struct, tag=True):
    pass


EngineInput = AddRequest | AbortRequests | UtilityCall | Shutdown


# ---- engine -> frontend ----------------------------------------------------------------------

class TokenLogprobs(msgspec.Struct, array_like=True):
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class RequestTimes(msgspec.Struct):
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    last_token: float | None
    finished: float | None


class RequestOutput(msgspec.Struct):
    """What changed for one request in one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "prefilled"
    error: str | None = None
    error_status: int = 400  # HTTP status the error maps to: 400 bad request, 500 engine failure, 503 unavailable
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    times: RequestTimes | None = None  # sent with the final output


class EngineOutputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    result: dict | None = None
    error: str | None = None


class EngineReady(msgspec.Struct, tag=True):
    num_blocks: int
    block_size: int
    max_model_len: int
    model_name: str
    profile: dict  # what the worker's profile run measured; empty when the block count was given


class EngineDead(msgspec.Struct, tag=True):
    error: str


EngineMessage = EngineOutputs | UtilityResult | EngineReady | EngineDead


# ---- engine -> worker ------------------------------------------------------------------------

class NewRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]


class Chunk(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]
    num_computed: int
    block_table: list[int]
    sample: bool  # this chunk reaches the request's last known token: sample the next one


class ExecuteStep(msgspec.Struct, tag=True):
    new_requests: list[NewRequest]
    finished_ids: list[str]
    chunks: list[Chunk]


class WorkerShutdown(msgspec.Struct, tag=True):
    pass


class WeightsCommand(msgspec.Struct, tag=True):
    """Free the weights and the KV cache ("clear"), or load both again from disk ("load")."""

    action: str


WorkerInput = ExecuteStep | WeightsCommand | WorkerShutdown


# ---- worker -> engine ------------------------------------------------------------------------

class Sampled(msgspec.Struct, array_like=True):
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None = None


class StepResult(msgspec.Struct, tag=True):
    sampled: list[Sampled]


class WorkerReady(msgspec.Struct, tag=True):
    num_blocks: int
    max_model_len: int
    vocab_size: int
    kv_cache_name: str | None  # shared-memory segment holding the cache (CPU), None on CUDA
    profile: dict  # what the profile run measured (empty when the block count was given)


class WorkerError(msgspec.Struct, tag=True):
    error: str


class WorkerOk(msgspec.Struct, tag=True):
    pass


WorkerMessage = StepResult | WorkerReady | WorkerError | WorkerOk
