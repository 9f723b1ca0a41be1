"""From per-request records to the seed 003 table: throughputs, then percentiles of decode speed,
TTFT, S_TTFT, TPOT, ITL and end-to-end latency; goodput under SLOs; a TTFT breakdown."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdserve.bench_serve.client import RequestRecord

NA = None  # a metric the server gave no data for: shown as n/a, never as 0


@dataclass
class Distribution:
    mean: float | None
    median: float | None
    percentiles: dict[str, float | None]

    @classmethod
    def of(cls, values: list[float], percentiles: list[float]) -> Distribution:
        if not values:
            return cls(NA, NA, {_label(p): NA for p in percentiles})
        arr = np.asarray(values, dtype=float)
        return cls(float(arr.mean()), float(np.median(arr)),
                   {_label(p): float(np.percentile(arr, p)) for p in percentiles})


def _label(p: float) -> str:
    return f"P{p:g}"


@dataclass
class Summary:
    completed: int
    failed: int  # errors other than refusals
    duration: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_throughput: float
    decode: Distribution  # tok/s per request
    ttft: Distribution  # ms, client
    s_ttft: Distribution  # ms, server: engine start (first scheduled) -> first token
    tpot: Distribution  # ms
    itl: Distribution  # ms
    e2el: Distribution  # ms
    goodput: float | None  # requests/s meeting every SLO (vLLM's definition); None without SLOs
    slo_attainment: float | None  # share of the requests sent (failed ones included) meeting every SLO
    first_error: str | None
    ttft_breakdown: dict[str, float] = field(default_factory=dict)  # mean ms per phase, when the server says
    refused: int = 0  # answered 429 (admission by SLO, rate limits): the server shed that load
    offered_rate: float = 0.0  # requests sent per second


def summarize(records: list[RequestRecord], duration: float, percentiles: list[float],
              slos: dict[str, float] | None = None) -> Summary:
    ok = [r for r in records if r.ok]
    dist = lambda values: Distribution.of(values, percentiles)  # noqa: E731
    decode, s_ttft, tpot = [], [], []
    for r in ok:
        if r.output_tokens > 1:
            if r.server_first is not None and r.server_last is not None and r.server_last > r.server_first:
                decode.append((r.output_tokens - 1) / (r.server_last - r.server_first))
            elif len(r.chunk_times) > 1 and r.chunk_times[-1] > r.chunk_times[0]:
                decode.append((r.output_tokens - 1) / (r.chunk_times[-1] - r.chunk_times[0]))
            tpot.append((r.e2el - r.ttft) / (r.output_tokens - 1) * 1000)
        m = r.server or {}
        if m.get("first_token") is not None and m.get("prefill_start") is not None:
            s_ttft.append((m["first_token"] - m["prefill_start"]) * 1000)
    goodput = attainment = None
    if slos:
        good = sum(meets_slos(r, slos) for r in ok)
        goodput, attainment = good / duration, good / max(1, len(records))
    inputs = sum(r.prompt_tokens for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    errors = [r.error for r in records if not r.ok and r.error and r.status != 429]
    refused = sum(r.status == 429 for r in records)
    return Summary(
        completed=len(ok), failed=len(records) - len(ok) - refused, duration=duration, input_tokens=inputs,
        output_tokens=outputs, request_throughput=len(ok) / duration, output_throughput=outputs / duration,
        total_throughput=(inputs + outputs) / duration, decode=dist(decode),
        ttft=dist([r.ttft * 1000 for r in ok]), s_ttft=dist(s_ttft), tpot=dist(tpot),
        itl=dist([g * 1000 for r in ok for g in r.itl]), e2el=dist([r.e2el * 1000 for r in ok]),
        goodput=goodput, slo_attainment=attainment, first_error=errors[0] if errors else None,
        ttft_breakdown=ttft_breakdown(ok), refused=refused, offered_rate=len(records) / duration)


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    """vLLM's good request: each SLO'd metric (ms) at or under its bound; TPOT is 0 for one-token answers."""
    t = {"ttft": r.ttft * 1000, "e2el": r.e2el * 1000,
         "tpot": (r.e2el - r.ttft) / (r.output_tokens - 1) * 1000 if r.output_tokens > 1 else 0.0}
    return all(t[k] <= v for k, v in slos.items())


# (label, from, to) in the server's per-request timings; PD requests have the middle ones
PHASES_PD = [("decode admission", "arrival", "preallocated"), ("prefill queue", "cache_info_sent", "prefill_start"),
             ("prefill + KV stream", "prefill_start", "last_layer_written"),
             ("KV transfer tail", "last_layer_written", "prefill_done_received"),
             # with a splitwise cache buffer on D: waiting for D's cache blocks, then the copy into them
             ("buffer wait", "buffered", "swap_started"), ("buffer -> cache copy", "swap_started", "swapped_in")]
PHASES_MIXED = [("queue", "arrival", "prefill_start"), ("prefill", "prefill_start", "first_token")]


def ttft_breakdown(records: list[RequestRecord]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for r in records:
        m = r.server or {}
        phases = PHASES_PD if "preallocated" in m else PHASES_MIXED
        for label, a, b in phases:
            if m.get(a) is not None and m.get(b) is not None:
                sums.setdefault(label, []).append((m[b] - m[a]) * 1000)
    return {k: float(np.mean(v)) for k, v in sums.items()}


def parse_slos(items: list[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        slos[name] = float(value)
    return slos
