"""Messages between the frontend (LLM / API server) and the engine process (the engine <-> worker protocol is
worker/protocol.py).

All msgspec Structs encoded as msgpack: typed on both ends, no pickle on any socket.
"""

from __future__ import annotations

import time

import msgspec

from pdserve.admission.load import LoadReport
from pdserve.engine.prefix_pull import PullHint
from pdserve.engine.stats import EngineStats
from pdserve.sampling import SamplingParams
from pdserve.worker.protocol import TokenLogprobs

# ---- frontend -> engine ----------------------------------------------------------------------

class PDParams(msgspec.Struct):
    """A request's part in a PD pair, as the router sent it to both instances."""

    transfer_id: str  # the same on P and D
    role: str  # "prefill": compute the prompt, send its KV, stop after the first token; "decode": the rest
    prefill_addr: str | None = None  # decode side: host:port of P's --pd-comm-port
    transport: str | None = None  # decode side: the protocol the router chose for this pair (None: any)


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    pd: PDParams | None = None
    # A migrated answer: the last num_resumed prompt tokens are output an earlier instance streamed.
    # They are computed as prompt, and count as output for sampling (penalties, grammar, seed).
    num_resumed: int = 0
    priority: int = 0  # --scheduling-policy priority: lower is served first
    lora_name: str | None = None  # the LoRA adapter it computes with (None: the base model)
    kv_pull: PullHint | None = None  # a peer holding a longer prefix, to pull it from (--enable-kv-pull)
    trace_steps: bool = False  # a traced request with --collect-detailed-traces: record its steps (RequestTimes.steps)


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class GetStats(msgspec.Struct, tag=True):
    """Answered with the engine's figures (UtilityResult.stats)."""


class CheckIdle(msgspec.Struct, tag=True):
    """A debug check for an idle engine: nothing unfinished, every KV block free; answered with the figures."""


class ResetPrefixCache(msgspec.Struct, tag=True):
    pass


class ClearWeights(msgspec.Struct, tag=True):
    """Abort everything, free the weights and the KV cache (POST /clear_load_weight)."""


class LoadWeights(msgspec.Struct, tag=True):
    """Load the weights and make the KV cache again (POST /update_model_weight)."""


class SetRole(msgspec.Struct, tag=True):
    role: str  # mixed, prefill or decode (--enable-role-switch)


class LoadLoRA(msgspec.Struct, tag=True):
    name: str
    path: str


class UnloadLoRA(msgspec.Struct, tag=True):
    name: str


Utility = GetStats | CheckIdle | ResetPrefixCache | ClearWeights | LoadWeights | SetRole | LoadLoRA | UnloadLoRA


class UtilityCall(msgspec.Struct, tag=True):
    """A synchronous call answered by a UtilityResult with the same call_id."""

    call_id: int
    call: Utility


class Shutdown(msgspec.Struct, tag=True):
    pass


EngineInput = AddRequest | AbortRequests | UtilityCall | Shutdown


# ---- engine -> frontend ----------------------------------------------------------------------

class StepTime(msgspec.Struct, array_like=True):
    """One engine step's part in a request: when the step was scheduled and ended, and the request's tokens in it."""

    started: float
    ended: float
    num_tokens: int


class RequestTimes(msgspec.Struct):
    """Engine-side timestamps (time.time()): kept on the Request as it runs, sent with its final output."""

    arrival: float = msgspec.field(default_factory=time.time)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    # PD requests, decode side (P's moments come with its *prefill done*)
    preallocated: float | None = None
    cache_info_sent: float | None = None
    first_layer_written: float | None = None
    last_layer_written: float | None = None
    prefill_done_received: float | None = None
    # ... with a splitwise cache buffer: the KV complete in the buffer, the copy into the cache started, done
    buffered: float | None = None
    swap_started: float | None = None
    swapped_in: float | None = None
    # ... the KV that came in from the prefill instance, and the transport that moved it
    kv_bytes: int | None = None
    kv_protocol: str | None = None
    preempted: list[float] = []  # each time it was preempted (its KV given up, to be computed again)
    steps: list[StepTime] | None = None  # AddRequest.trace_steps: every step that computed some of it


class RequestOutput(msgspec.Struct):
    """What changed for one request in one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "prefilled"
    error: str | None = None
    error_status: int = 400  # HTTP status the error maps to: 400 bad request, 500 engine failure, 503 unavailable
    error_type: str | None = None  # the OpenAI error body's "type" when not the status's default ("pd_error")
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    times: RequestTimes | None = None  # sent with the final output
    # params.prompt_logprobs: one entry per prompt token after the first, with the first output token
    prompt_logprobs: list[TokenLogprobs] | None = None


class EngineOutputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]
    load: LoadReport | None = None  # the engine's queue and speed, every LOAD_INTERVAL while it works


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    result: dict | None = None
    error: str | None = None
    stats: EngineStats | None = None  # the answer to `stats` and `check_idle`


class EngineReady(msgspec.Struct, tag=True):
    num_blocks: int
    block_size: int
    max_model_len: int
    model_name: str
    profile: dict  # what the worker's profile run measured; empty when the block count was given
    role: str = "mixed"
    pd_comm_port: int | None = None  # where the control plane listens (PD roles)
    transports: list[str] = []  # cache transfer protocols this instance offers, in preference order
    startup: list[dict] = []  # the startup log: which process started when, who created the cache
    compatibility_key: str = ""  # model + KV layout: a router pairs P and D only if theirs are equal
    kv_events: str | None = None  # where its KV events are published (the bound ZMQ address)
    kv_events_replay: str | None = None  # ... and replayed
    kv_pull_port: int | None = None  # --enable-kv-pull: the cache service's block server (peers pull from it)
    pd_sides: list[str] = []  # the PD sides its role takes ("prefill", "decode"; a switchable mixed one: decode)
    stats: EngineStats | None = None  # its figures when ready: /metrics has every series from the start


class EngineDead(msgspec.Struct, tag=True):
    error: str


EngineMessage = EngineOutputs | UtilityResult | EngineReady | EngineDead
