"""One interval's load, from the counters the deployment already exports (Prometheus text of its /metrics).

Answers are counted where they finish: mixed and decode instances (`pdserve_requests_total`, their prompt and
generated tokens); a prefill instance's part of a PD request is not an answer. Refusals are the routers' 429s
(admission, rate limits). What waits at the interval's end is the instances' waiting requests at the interval's
mean prompt length: work the next interval carries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
class Snapshot:
    """The counters at one moment, summed over the deployment."""

    requests: float = 0.0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    refused: float = 0.0
    waiting: float = 0.0  # a gauge: requests waiting now

    @classmethod
    def of(cls, routers: list[str], instances: list[tuple[str, str]]) -> Snapshot:
        """`routers`: their /metrics texts; `instances`: (role, /metrics text) of each instance."""
        answering = [text for role, text in instances if role in ANSWERING_ROLES]
        return cls(requests=sum(total(t, "pdserve_requests_total") for t in answering),
                   prompt_tokens=sum(total(t, "pdserve_prompt_tokens_total") for t in answering),
                   output_tokens=sum(total(t, "pdserve_generation_tokens_total") for t in answering),
                   refused=sum(total(t, "pdserve_router_requests_total", status="429") for t in routers),
                   waiting=sum(total(t, "pdserve_num_requests_waiting") for _, t in instances))


def interval(before: Snapshot, after: Snapshot, seconds: float) -> IntervalLoad:
    requests = int(after.requests - before.requests)
    prompt = int(after.prompt_tokens - before.prompt_tokens)
    mean_prompt = prompt / requests if requests else 0.0
    return IntervalLoad(seconds, requests, int(after.refused - before.refused), prompt,
                        int(after.output_tokens - before.output_tokens), int(after.waiting * mean_prompt))
