"""`--metrics-url`: where a run's prompt tokens came from, by the instances' own counters (their /metrics before
and after): device, host, disk or pulled from a peer (`pdserve_prefix_cache_hits_by_tier_total`), and the prefill
time each tier saved: its tokens at the instances' measured cost of a prompt token (the median engine's
`pdserve_prefill_tokens_per_second`), less the engines' wait for its copies."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import httpx

TIERS = ("device", "host", "disk", "pulled")
_WAITS = {"host": "pdserve_host_cache_swap_in_seconds_total", "disk": "pdserve_disk_cache_load_seconds_total",
          "pulled": "pdserve_kv_pull_seconds_total"}
_SAMPLE = re.compile(r'^(pdserve_[a-z_]+)(?:\{([^}]*)\})? (\S+)$')


@dataclass
class TierCounters:
    hit_tokens: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIERS, 0.0))
    wait_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIERS, 0.0))
    queried_tokens: float = 0.0
    prefill_rates: list[float] = field(default_factory=list)  # tokens/s, one per engine that measured one

    def add(self, other: TierCounters, sign: float = 1.0) -> None:
        for tier in TIERS:
            self.hit_tokens[tier] += sign * other.hit_tokens[tier]
            self.wait_seconds[tier] += sign * other.wait_seconds[tier]
        self.queried_tokens += sign * other.queried_tokens
        if sign > 0:  # rates are not counters: a difference keeps the later ones
            self.prefill_rates += other.prefill_rates

    @property
    def prefill_rate(self) -> float:
        rates = sorted(self.prefill_rates)
        return rates[len(rates) // 2] if rates else 0.0

    def saved_seconds(self, tier: str) -> float | None:
        """Prefill time the tier's hits saved (None: no prefill rate measured)."""
        rate = self.prefill_rate
        return self.hit_tokens[tier] / rate - self.wait_seconds[tier] if rate else None


def parse(text: str) -> TierCounters:
    """One instance's /metrics text, summed over its data-parallel ranks."""
    out = TierCounters()
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if name == "pdserve_prefix_cache_hits_by_tier_total":
            tier = re.search(r'tier="([a-z]+)"', labels)
            if tier and tier.group(1) in out.hit_tokens:
                out.hit_tokens[tier.group(1)] += value
        elif name == "pdserve_prefix_cache_queries_total":
            out.queried_tokens += value
        elif name == "pdserve_prefill_tokens_per_second" and value > 0:
            out.prefill_rates.append(value)
        else:
            for tier, metric in _WAITS.items():
                if name == metric:
                    out.wait_seconds[tier] += value
    return out


def scrape(urls: list[str]) -> TierCounters:
    total = TierCounters()
    for url in urls:
        total.add(parse(httpx.get(url, timeout=10).text))
    return total


def format_tiers(run: TierCounters) -> str:
    lines = ["=" * 12 + " Prefix hits by tier " + "=" * 12,
             f"{'tier':>8}{'hit tokens':>12}{'share':>8}{'wait s':>9}{'saved s':>9}"]
    for tier in TIERS:
        share = run.hit_tokens[tier] / run.queried_tokens if run.queried_tokens else 0.0
        saved = run.saved_seconds(tier)
        lines.append(f"{tier:>8}{run.hit_tokens[tier]:>12.0f}{share:>8.1%}{run.wait_seconds[tier]:>9.2f}"
                     f"{'n/a' if saved is None else f'{saved:.2f}':>9}")
    lines.append(f"(saved: hit tokens at the engines' median prefill rate, {run.prefill_rate:.0f} tokens/s, less the "
                 f"wait; of {run.queried_tokens:.0f} prompt tokens looked up)")
    return "\n".join(lines)
