"""The API server's shared state (at `app.state.server`, read through `ServerDep`), and the error its
handlers raise (an OpenAI-format error body)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from pdserve.admission.sent import SentSince
from pdserve.api.admission import ServerAdmission
from pdserve.api.async_engine import AsyncEngine
from pdserve.api.data_parallel import DataParallelEngine
from pdserve.api.generation import Generation
from pdserve.api.lora import LoRAServing
from pdserve.api.metrics import ServerMetrics
from pdserve.api.prompt_work import PromptWork
from pdserve.api.role_change import RoleChanger
from pdserve.api.status import RecentRequests
from pdserve.tokenization.tokenizer import Tokenizer
from pdserve.tracing import genai
from pdserve.utils.cluster_auth import SignatureCheck, cluster_secret

if TYPE_CHECKING:  # OpenTelemetry is imported only when tracing is on
    from pdserve.api.tracing import InstanceTracing


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, err_type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.err_type, self.param, self.headers = status, err_type, param, headers


@dataclass
class ServerState:
    engine: AsyncEngine | DataParallelEngine
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    max_concurrency: int
    metrics: ServerMetrics
    in_flight: int = 0
    weights_cleared: bool = False
    router_urls: list[str] = field(default_factory=list)  # --router: register with each every few seconds
    instances: list[dict] = field(default_factory=list)  # what to register (one per data-parallel rank in PD)
    api_key: str | None = None  # --api-key: /v1 requests must carry it as a Bearer token
    sampling_defaults: dict | None = None  # the model's generation_config values for omitted fields
    request_shutdown: Callable[[], None] | None = None  # stops the HTTP server (set by `pdserve serve`)
    exit_code: int = 0  # 1 once the engine died
    tool_call_parser: str = "hermes"  # --tool-call-parser
    data_parallel_size: int = 1  # engine is a DataParallelEngine when above 1
    scheduling_policy: str = "fcfs"  # the engine's --scheduling-policy: a `priority` other than 0 needs "priority"
    admission: ServerAdmission | None = None  # --ttft-slo-ms, --tpot-slo-ms, --rate-limit
    # Requests handed to the engine lately, which its last load report may not include yet (admission/sent.py),
    # and per router the highest of its sequence numbers taken.
    taken: SentSince = field(default_factory=SentSince)
    prompt_work: PromptWork | None = None  # what the engine will compute of a prompt (set once it is ready)
    acked: dict[str, int] = field(default_factory=dict)
    lora: LoRAServing | None = None  # --enable-lora: the adapters a request may name in `model`
    kv_pull: bool = False  # --enable-kv-pull: a request's `kv_pull` is followed
    role: str = "mixed"  # the role it started in
    role_changer: RoleChanger | None = None  # --enable-role-switch: POST /role changes it
    signatures: SignatureCheck = field(default_factory=lambda: SignatureCheck(cluster_secret()))
    tracing: InstanceTracing | None = None  # --otlp-traces-endpoint
    recent: RecentRequests = field(default_factory=RecentRequests)  # the last minute, for GET /status

    def prompt_tokens_to_compute(self, gen: Generation) -> int:
        prompt = gen.prompt_token_ids
        return len(prompt) if self.prompt_work is None else self.prompt_work.tokens(prompt, gen.lora_name)

    @property
    def current_role(self) -> str:
        return self.role_changer.role if self.role_changer is not None else self.role

    def announce_loras(self) -> None:
        """The adapters it serves go into its registrations (the next heartbeat tells the routers)."""
        for instance in self.instances:
            instance["loras"] = sorted(self.lora.adapters) if self.lora is not None else []

    def request_finished(self, gen: Generation, outcome: str | None = None) -> None:
        """Once per request, however it ended: its metrics, and what admission charges or learns from it."""
        self.metrics.request_finished(gen, outcome)
        self.recent.finished(*gen.latencies())
        if gen.trace is not None:
            finish_span(gen, outcome, self.model_name)
        if self.admission is not None and gen.admitted is not None:
            self.admission.finished(gen.admitted, gen.completion_tokens, gen.latencies()[0])


def finish_span(gen: Generation, outcome: str | None, model: str) -> None:
    """The request's span ends with what it answered: the GenAI usage and finish reasons."""
    reasons = [gen.finish_reasons[i] for i in sorted(gen.finish_reasons)]
    usage = gen.usage()
    attributes = {genai.RESPONSE_ID: gen.request_id, genai.RESPONSE_MODEL: model,
                  genai.FINISH_REASONS: reasons or [outcome or "abort"],
                  genai.INPUT_TOKENS: usage["prompt_tokens"], genai.OUTPUT_TOKENS: usage["completion_tokens"],
                  genai.CACHED_INPUT_TOKENS: usage["prompt_tokens_details"]["cached_tokens"]}
    if gen.resumed:
        attributes["pdserve.migration.resumed_tokens"] = len(gen.resumed)
    error = outcome if outcome in ("error", "abort") else None
    gen.trace.finish(gen.times.get(0), attributes, error, time.time())


async def server_state(request: Request) -> ServerState:
    """The server's state (async: FastAPI would run a plain function in its thread pool)."""
    return request.app.state.server


ServerDep = Annotated[ServerState, Depends(server_state)]
