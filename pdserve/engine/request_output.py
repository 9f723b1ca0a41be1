"""RequestOutput messages built from a Request (the engine and the PD connector both send them)."""

from __future__ import annotations

import msgspec

from pdserve.engine.messages import RequestOutput
from pdserve.engine.request import Request


def final_output(r: Request) -> RequestOutput:
    return RequestOutput(
        r.request_id, [], finish_reason=r.finish_reason, num_prompt_tokens=r.num_prompt_tokens,
        num_cached_tokens=r.num_cached_tokens, num_preemptions=r.num_preemptions,
        times=msgspec.structs.replace(r.times))  # a copy: the request may still change its own


def error_output(r: Request, error: str, status: int = 500, error_type: str | None = None) -> RequestOutput:
    r.finish_reason = "error"
    out = final_output(r)
    out.error, out.error_status, out.error_type = error, status, error_type
    return out
