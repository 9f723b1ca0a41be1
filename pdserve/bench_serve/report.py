"""The seed 003 table on stdout, the JSON result file, and the PNG plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from pdserve.bench_serve.client import RequestRecord
from pdserve.bench_serve.summary import Distribution, Summary

WIDTH = 50


def _row(label: str, value: float | int | str | None, fmt: str = "{:.2f}") -> str:
    text = "n/a" if value is None else (fmt.format(value) if not isinstance(value, str) else value)
    return f"{label:<40} {text:<10}"


def _section(title: str, name: str, unit: str, d: Distribution) -> list[str]:
    lines = [f" {title} ".center(WIDTH, "-")]
    suffix = f" ({unit})" if unit else ""
    lines.append(_row(f"Mean {name}{suffix}:", d.mean))
    lines.append(_row(f"Median {name}{suffix}:", d.median))
    lines += [_row(f"{p} {name}{suffix}:", v) for p, v in d.percentiles.items()]
    return lines


def format_table(s: Summary) -> str:
    lines = [" Serving Benchmark Result ".center(WIDTH, "="),
             _row("Successful requests:", s.completed, "{}"),
             _row("Failed requests:", s.failed, "{}"),
             _row("Refused requests (429):", s.refused, "{}"),
             _row("Offered load (req/s):", s.offered_rate, "{:.3f}"),
             _row("Benchmark duration (s):", s.duration),
             _row("Total input tokens:", s.input_tokens, "{}"),
             _row("Total generated tokens:", s.output_tokens, "{}"),
             _row("Request throughput (req/s):", s.request_throughput, "{:.3f}"),
             _row("Output token throughput (tok/s):", s.output_throughput),
             _row("Total Token throughput (tok/s):", s.total_throughput)]
    if s.goodput is not None:
        lines.append(_row("Request goodput (req/s):", s.goodput, "{:.3f}"))
        lines.append(_row("Requests meeting the SLOs (%):", 100 * (s.slo_attainment or 0.0), "{:.1f}"))
        lines.append(_row("Goodput / offered load (%):", 100 * s.goodput / s.offered_rate if s.offered_rate else 0.0,
                          "{:.1f}"))
    lines += _section("Decode speed (tok/s)", "Decode", "", s.decode)
    lines += _section("Time to First Token", "TTFT", "ms", s.ttft)
    lines += _section("Infer Time to First Token", "S_TTFT", "ms", s.s_ttft)
    lines += _section("Time per Output Token (excl. 1st token)", "TPOT", "ms", s.tpot)
    lines += _section("Inter-token Latency", "ITL", "ms", s.itl)
    lines += _section("End-to-end Latency", "E2EL", "ms", s.e2el)
    if s.ttft_breakdown:
        lines.append(" TTFT breakdown (server, mean ms) ".center(WIDTH, "-"))
        lines += [_row(f"{k}:", v) for k, v in s.ttft_breakdown.items()]
    if s.first_error:
        lines.append(" Failed requests ".center(WIDTH, "-"))
        lines.append(f"first error: {s.first_error}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def save_result(path: Path, summary: Summary, records: list[RequestRecord], config: dict, **extra: object) -> None:
    """`extra`: more top-level keys (the multi-turn run's by-turn rows)."""
    path.write_text(json.dumps({"config": config, "summary": asdict(summary), **extra,
                                "requests": [r.as_dict() for r in records]}, indent=1))


def save_probes(path: Path, runs: list[dict], best: float | None, target: float, config: dict) -> None:
    """--find-rate: every probe's summary and requests, and the rate found."""
    path.write_text(json.dumps({
        "config": config, "found_rate": best, "target": target,
        "probes": [{"rate": r["rate"], "summary": asdict(r["summary"]),
                    "requests": [rec.as_dict() for rec in r["records"]]} for r in runs]}, indent=1))


def plot(path: Path, records: list[RequestRecord]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].hist([r.ttft * 1000 for r in ok], bins=30)
    axes[0].set(title="TTFT", xlabel="ms", ylabel="requests")
    axes[1].hist([g * 1000 for r in ok for g in r.itl], bins=50)
    axes[1].set(title="Inter-token latency", xlabel="ms", ylabel="gaps")
    if ok:
        t0 = min(r.start for r in ok)
        stamps = sorted(r.start - t0 + c for r in ok for c in r.chunk_times)
        end = stamps[-1] if stamps else 1.0
        bins = max(1, int(end) + 1)
        axes[2].hist(stamps, bins=bins, range=(0, bins))
    axes[2].set(title="Tokens streamed per second", xlabel="s since start", ylabel="tokens/s")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
