"""One interval's load, from the counters the deployment already exports (Prometheus text of its /metrics).

Answers are counted where they finish: mixed and decode instances (`pdserve_requests_total`, their prompt and
generated tokens); a prefill instance's part of a PD request is not an answer. Each instance's counters are
differenced on their own, so an instance that changed role between two snapshots adds only what it did between
them. Refusals are the routers' 429s (admission, rate limits). What waits at the interval's end is the instances'
waiting requests at the interval's mean prompt length: work the next interval carries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pdserve.planner.predictor import IntervalLoad

_SAMPLE = re.compile(r'^([a-z_:]+)(?:\{([^}]*)\})? (\S+)$')
ANSWERING_ROLES = ("mixed", "decode")


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if (match := _SAMPLE.match(line)) is not None:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            out.append((match.group(1), labels, float(match.group(3))))
    return out


def total(text: str, name: str, **labels: str) -> float:
    return sum(v for n, got, v in samples(text) if n == name and all(got.get(k) == w for k, w in labels.items()))


@dataclass(frozen=True)
class Counters:
    """One instance's counters at one moment."""

    requests: float = 0.0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    waiting: float = 0.0  # a gauge: requests waiting now
    running: float = 0.0  # a gauge: streams in the decode batch now
    ttft_sum: float = 0.0  # seconds, over ttft_count first tokens
    ttft_count: float = 0.0
    tpot_sum: float = 0.0  # seconds, over tpot_count requests' mean gaps
    tpot_count: float = 0.0

    @classmethod
    def of(cls, text: str) -> Counters:
        return cls(total(text, "pdserve_requests_total"), total(text, "pdserve_prompt_tokens_total"),
                   total(text, "pdserve_generation_tokens_total"), total(text, "pdserve_num_requests_waiting"),
                   total(text, "pdserve_num_requests_running"),
                   total(text, "pdserve_time_to_first_token_seconds_sum"),
                   total(text, "pdserve_time_to_first_token_seconds_count"),
                   total(text, "pdserve_time_per_output_token_seconds_sum"),
                   total(text, "pdserve_time_per_output_token_seconds_count"))


@dataclass(frozen=True)
class Snapshot:
    """The deployment's counters at one moment: each instance's (with its role then) and the routers' refusals."""

    instances: dict[str, tuple[str, Counters]] = field(default_factory=dict)
    refused: float = 0.0

    @classmethod
    def of(cls, routers: list[str], instances: dict[str, tuple[str, str]]) -> Snapshot:
        """`routers`: their /metrics texts; `instances`: url -> (role, /metrics text)."""
        return cls({url: (role, Counters.of(text)) for url, (role, text) in instances.items()},
                   sum(total(t, "pdserve_router_requests_total", status="429") for t in routers))


def interval(before: Snapshot, after: Snapshot, seconds: float) -> IntervalLoad:
    requests = prompt = output = ttft_sum = ttft_n = tpot_sum = tpot_n = streams = 0.0
    for url, (role, now) in after.instances.items():
        if role not in ANSWERING_ROLES:
            continue
        if url not in before.instances:  # new to the planner: what it did before is not this interval's
            continue
        then = before.instances[url][1]
        if now.requests < then.requests:  # restarted: its counters began again
            then = Counters()
        requests += now.requests - then.requests
        prompt += now.prompt_tokens - then.prompt_tokens
        output += now.output_tokens - then.output_tokens
        ttft_sum, ttft_n = ttft_sum + now.ttft_sum - then.ttft_sum, ttft_n + now.ttft_count - then.ttft_count
        tpot_sum, tpot_n = tpot_sum + now.tpot_sum - then.tpot_sum, tpot_n + now.tpot_count - then.tpot_count
        streams += (now.running + then.running) / 2
    waiting = sum(c.waiting for _, c in after.instances.values())
    mean_prompt = prompt / requests if requests else 0.0
    return IntervalLoad(seconds, int(requests), int(max(0.0, after.refused - before.refused)), int(prompt),
                        int(output), int(waiting * mean_prompt), ttft_sum / ttft_n if ttft_n > 0 else None,
                        tpot_sum / tpot_n if tpot_n > 0 else None, streams)
