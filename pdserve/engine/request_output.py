"""RequestOutput messages built from a Request (the engine and the PD connector both send them)."""

from __future__ import annotations

from pdserve.engine.messages import RequestOutput, RequestTimes
from pdserve.engine.request import Request


def final_output(r: Request) -> RequestOutput:
    t = r.times
    return RequestOutput(
        r.request_id, [], finish_reason=r.finish_reason, num_prompt_tokens=r.num_prompt_tokens,
        num_cached_tokens=r.num_cached_tokens, num_preemptions=r.num_preemptions,
        times=RequestTimes(t.arrival, t.first_scheduled, t.first_token, t.last_token, t.finished,
                           t.preallocated, t.cache_info_sent, t.first_layer_written, t.last_layer_written,
                           t.prefill_done_received))


def error_output(r: Request, error: str, status: int = 500) -> RequestOutput:
    r.finish_reason = "error"
    out = final_output(r)
    out.error, out.error_status = error, status
    return out
