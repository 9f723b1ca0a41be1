"""Requests from the frontend into the engine: a new one goes to the scheduler (or, in a PD pair, to the role's
connector); one the engine cannot take now is answered at once with an error output, never dropped."""

from __future__ import annotations

from typing import Protocol

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.messages import AbortRequests, AddRequest, RequestOutput
from pdserve.engine.request import Request
from pdserve.engine.request_output import final_output
from pdserve.engine.role_connectors import RoleConnectors
from pdserve.engine.scheduler import Scheduler


class Engine(Protocol):
    """What intake reads and calls of the engine core."""

    scheduler: Scheduler
    kv: KVCacheManager
    connector: RoleConnectors
    weights_loaded: bool
    loras: set[str]

    def abort(self, request_id: str) -> Request | None: ...


class Intake:
    def __init__(self, core: Engine) -> None:
        self.core = core

    def handle(self, msg: AddRequest | AbortRequests) -> list[RequestOutput]:
        if isinstance(msg, AbortRequests):
            return [final_output(r) for rid in msg.request_ids if (r := self.core.abort(rid)) is not None]
        if (why := self._refusal(msg)) is not None:
            return [why]
        request = self._request(msg)
        try:
            if msg.pd is None:
                self.core.scheduler.add_request(request)
                return []
            if msg.params.prompt_logprobs is not None:
                raise ValueError("prompt logprobs (echo with logprobs, prompt_logprobs) are not served by a PD pair: "
                                 "send the request without `pd`, to one instance (pdserve's router does)")
            return self.core.connector.add_request(request, msg.pd)
        except ValueError as e:
            return [_error(msg, str(e))]

    def _refusal(self, msg: AddRequest) -> RequestOutput | None:
        if not self.core.weights_loaded:
            return _error(msg, "the model weights are cleared; POST /update_model_weight loads them", 503)
        if msg.lora_name is not None and msg.lora_name not in self.core.loras:  # unloaded since the API checked it
            return _error(msg, f"the LoRA adapter '{msg.lora_name}' is not loaded")
        return None

    def _request(self, msg: AddRequest) -> Request:
        request = Request(msg.request_id, msg.prompt_token_ids, msg.params, tuple(msg.eos_token_ids),
                          num_resumed=msg.num_resumed, priority=msg.priority, lora_name=msg.lora_name,
                          kv_pull=msg.kv_pull if self.core.kv.pulls is not None else None)
        request.times.arrival = msg.arrival_time
        if msg.trace_steps:
            request.times.steps = []
        return request


def _error(msg: AddRequest, error: str, status: int = 400) -> RequestOutput:
    return RequestOutput(msg.request_id, [], finish_reason="error", error=error, error_status=status,
                         num_prompt_tokens=len(msg.prompt_token_ids))
