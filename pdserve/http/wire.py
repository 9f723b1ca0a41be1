"""The JSON the router and the instances exchange besides OpenAI's own bodies, defined once: the
instance's registration heartbeat, and the PD instructions the router adds to a request (`pd`).
(The OpenAI error body is in errors.py.) Both the API server and the router import these; neither
imports the other.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# A router's generation request carries "ROUTER_ID:SEQ" in this header; the instance's /load?router=ROUTER_ID
# answers with the highest SEQ it has taken from that router (LoadReport.acked: admission/sent.py).
SENT_HEADER = "x-pdserve-sent"


def parse_sent(value: str | None) -> tuple[str, int] | None:
    """(router id, sequence number) from the header, None when absent or malformed."""
    router, _, seq = (value or "").rpartition(":")
    return (router, int(seq)) if router and seq.isdigit() else None


class KVEventSource(BaseModel):
    """Where one engine of an instance publishes its KV events (kv_events/): vLLM's PUB and replay sockets; and,
    with --enable-kv-pull, where peers pull the blocks those events name (its block server, host:port)."""

    endpoint: str = Field(min_length=1, max_length=300)  # e.g. tcp://10.0.0.5:40123
    replay: str | None = Field(None, max_length=300)
    pull: str | None = Field(None, max_length=300)  # e.g. 10.0.0.5:40125


class Registration(BaseModel):
    """An instance, as it announces itself to the router (POST /register, signed; api/registration.py)."""

    role: str = Field(pattern="^(mixed|prefill|decode)$")
    url: str = Field(min_length=1, max_length=500)  # the instance's HTTP address, e.g. http://10.0.0.5:8001
    model: str | None = None
    host: str | None = None  # the address peers use
    host_id: str | None = None  # equal on one host (and boot): only then may P and D use ipc
    pid: int | None = None  # the process on its host; a new pid at the same url is a restart
    metrics_port: int | None = None
    pd_comm: str | None = None  # prefill: host:port of its control plane
    transports: list[str] = []  # cache transfer protocols, in the instance's preference order
    tp_size: int = 1
    block_size: int | None = None
    compatibility_key: str | None = None  # model + KV layout; P and D pair only when theirs are equal
    kv_events: list[KVEventSource] = []  # one per engine (data-parallel rank) behind this url; none: no events
    loras: list[str] = []  # the LoRA adapters it serves (a request names one in `model`)
    pd_sides: list[Literal["prefill", "decode"]] = []  # PD sides it takes (a switchable mixed one: decode)
    draining: bool = False  # changing role: no new requests, those in flight finish


class PDRequest(BaseModel):
    """The router's instructions to each side of a PD pair (the request body's `pd` field)."""

    transfer_id: str = Field(min_length=1, max_length=200)
    role: Literal["prefill", "decode"]
    prefill_addr: str | None = None  # decode side: host:port of the prefill instance's --pd-comm-port
    transport: Literal["ipc", "tcp", "rdma"] | None = None  # decode side: the router's choice for this pair


class KVPull(BaseModel):
    """The router's word to an instance run with --enable-kv-pull (the body's `kv_pull`): the peer whose block
    server is at `addr` holds the prompt's first `num_blocks` blocks; pull what this instance lacks of them if
    that is cheaper than computing it."""

    addr: str = Field(min_length=3, max_length=300, pattern=r"^[^\s/]+:\d+$")  # host:port
    num_blocks: int = Field(ge=1)


class Migration(BaseModel):
    """The router's instructions for a stream it can move to another instance (the body's `migration`).

    Its presence asks the instance to name, in the stream, the token ids each event carries (an SSE
    comment line, `TOKENS_COMMENT`, which the router removes). With `token_ids`, the answer resumes
    after those tokens, which an earlier instance streamed: same id and created, no role chunk, usage
    counting them. One choice only (n = 1)."""

    token_ids: list[int] = []
    id: str | None = Field(None, max_length=200)
    created: int | None = None


TOKENS_COMMENT = b": pdserve-tokens"  # `: pdserve-tokens 12 345 6` before an event's data line
