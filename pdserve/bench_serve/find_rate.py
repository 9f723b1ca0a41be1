"""`pdserve bench serve --find-rate`: the highest Poisson rate at which a share of the requests (90% by
default) meets every SLO, DistServe's per-GPU goodput measure, found by doubling then bisecting."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Probe:
    rate: float  # requests/s sent
    attainment: float  # share of the requests sent that met every SLO (failed ones did not)
    goodput: float  # requests/s that met every SLO


def find_rate(measure: Callable[[float], Probe], start: float, target: float, steps: int,
              max_rate: float, max_halvings: int = 3) -> tuple[float | None, list[Probe]]:
    """The highest rate found to meet `target`, and every probe in the order run.

    Doubles from `start` while the target is met (up to `max_rate`), halves while it is not (up to
    `max_halvings` times), then bisects between the last rate met and the first missed `steps` times.
    None when not even the lowest rate tried meets it.
    """
    probes: list[Probe] = []

    def meets(rate: float) -> bool:
        probes.append(measure(rate))
        return probes[-1].attainment >= target

    met, missed = None, None
    if meets(start):
        met, rate = start, start * 2
        while rate <= max_rate and meets(rate):
            met, rate = rate, rate * 2
        missed = rate if rate <= max_rate else None
    else:
        missed, rate = start, start / 2
        for _ in range(max_halvings):
            if meets(rate):
                met = rate
                break
            missed, rate = rate, rate / 2
    if met is None or missed is None:
        return met, probes
    for _ in range(steps):
        mid = (met + missed) / 2
        if meets(mid):
            met = mid
        else:
            missed = mid
    return met, probes


def format_probes(probes: list[Probe], best: float | None, target: float) -> str:
    lines = ["", f"{'rate req/s':>12} {'SLO met':>9} {'goodput req/s':>14}"]
    lines += [f"{p.rate:>12.3f} {p.attainment:>8.1%} {p.goodput:>14.3f}" for p in sorted(probes, key=lambda p: p.rate)]
    found = f"{best:.3f} req/s" if best is not None else "none (not even the lowest rate tried)"
    lines.append(f"highest rate with >= {target:.0%} of requests meeting the SLO: {found}")
    return "\n".join(lines)


def plot_probes(path: Path, probes: list[Probe], best: float | None, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probes = sorted(probes, key=lambda p: p.rate)
    rates = [p.rate for p in probes]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(rates, [p.goodput for p in probes], "o-", label="goodput")
    a.plot(rates, rates, ":", color="grey", label="rate sent")
    a.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title="goodput against rate")
    a.legend()
    b.plot(rates, [p.attainment * 100 for p in probes], "o-")
    b.axhline(target * 100, color="red", linestyle="--", label=f"{target:.0%} target")
    if best is not None:
        b.axvline(best, color="green", linestyle=":", label=f"found {best:.2f} req/s")
    b.set(xlabel="request rate (req/s)", ylabel="requests meeting the SLO (%)", title="SLO attainment", ylim=(0, 105))
    b.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
