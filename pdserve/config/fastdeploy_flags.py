"""FastDeploy's command line (seed 000's usage block), as `pdserve serve` reads it.

Each FastDeploy flag is one row below: what FastDeploy means by it and what pdserve does with it:
`use` (pdserve reads the value), `unneeded` (parsed and checked, nothing to do here: say why in the
log), or a refusal test (the value asks for something pdserve does not have: the start ends with
exit 2 and one line per such flag, naming it and saying what pdserve offers instead).

FastDeploy's comma lists give one value per data-parallel rank: `--pd-comm-port` gives each of pdserve's
data-parallel ranks (`--data-parallel-size`, a server setting) its own; of the others the first value is used.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.config.quantization import QUANTIZATION_CHOICES

log = logging.getLogger("pdserve.serve")



def per_rank_ports(text: str) -> list[int]:
    """'9800,9801' -> [9800, 9801]: FastDeploy's one port per data-parallel rank."""
    try:
        ports = [int(p) for p in str(text).split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port or a comma list of ports, got {text!r}") from None
    if not ports or not all(0 < p < 65536 for p in ports):
        raise argparse.ArgumentTypeError(f"ports must be in 1..65535, got {text!r}")
    return ports


def first_port(text: str) -> int:
    """--pd-comm-port: a port, or FastDeploy's per-rank list of which rank 0's (the first) is ours."""
    return per_rank_ports(text)[0]


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


@dataclass(frozen=True)
class FDFlag:
    name: str
    kind: Callable[[str], Any] | None  # None: a switch
    unneeded: str = ""  # why pdserve needs no value (logged when the flag is given)
    refuse: Callable[[Any], str | None] = lambda value: None  # the reason a value cannot be served, or None


FLAGS: tuple[FDFlag, ...] = (
    FDFlag("--engine-worker-queue-port", per_rank_ports,
           unneeded="the engine and its worker talk over unix sockets in the instance's IPC folder"),
    FDFlag("--cache-queue-port", per_rank_ports,
           unneeded="the cache service is reached over a unix socket in the instance's IPC folder"),
    FDFlag("--workers", int, refuse=lambda n: "one HTTP process per instance (raise --max-concurrency); for more "
           "throughput start more instances behind `pdserve router`" if n > 1 else None),
    FDFlag("--enable-expert-parallel", None,
           refuse=lambda on: "no expert parallelism: pdserve serves dense models" if on else None),
    FDFlag("--disable-custom-all-reduce", None,
           unneeded="CPU ranks sum through pdserve's own shared-memory all-reduce, CUDA ranks through NCCL"),
    FDFlag("--scheduler-name", str, refuse=lambda name: None if name == "local" else (
        f"no {name!r} (Redis) scheduler: `pdserve router` pairs prefill and decode instances; give each "
        "instance --router URL")),
    FDFlag("--scheduler-host", str, unneeded="used by a Redis scheduler only"),
    FDFlag("--scheduler-port", int, unneeded="used by a Redis scheduler only"),
    FDFlag("--scheduler-password", str, unneeded="used by a Redis scheduler only"),
    FDFlag("--scheduler-topic", str, unneeded="used by a Redis scheduler only"),
    FDFlag("--scheduler-ttl", int, unneeded="used by a Redis scheduler only"),
    FDFlag("--ips", str, refuse=lambda ips: (
        f"one host per instance: run `pdserve serve` on each of {ips} with --router URL"
        if len([i for i in str(ips).split(",") if i.strip()]) > 1 else None)),
    FDFlag("--graph-optimization-config", json_object,
           unneeded="pdserve does not capture CUDA graphs yet; the model runs eagerly"),
)


def add_fastdeploy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("FastDeploy's flags (accepted so its command lines run; see "
                             "pdserve/config/fastdeploy_flags.py)")
    for f in FLAGS:
        dest = "fd_" + f.name.removeprefix("--").replace("-", "_")
        if f.kind is None:
            g.add_argument(f.name, dest=dest, action="store_true", default=None, help=f.unneeded or argparse.SUPPRESS)
        else:
            g.add_argument(f.name, dest=dest, type=f.kind, default=None, help=f.unneeded or argparse.SUPPRESS)


def fastdeploy_refusals(args: argparse.Namespace) -> list[str]:
    """One line per flag whose value pdserve cannot serve (engine flags with FastDeploy values included);
    logs what is accepted but unneeded."""
    lines, unneeded = [], []
    for f in FLAGS:
        value = getattr(args, "fd_" + f.name.removeprefix("--").replace("-", "_"), None)
        if value is None:
            continue
        if reason := f.refuse(value):
            shown = "" if f.kind is None else f" {value}"
            lines.append(f"{f.name}{shown}: {reason}")
        elif f.unneeded:
            unneeded.append(f)
    quantization = getattr(args, "quantization", None)
    if quantization not in (None, *QUANTIZATION_CHOICES):
        lines.append(f"--quantization {quantization}: not available; pdserve offers {', '.join(QUANTIZATION_CHOICES)}")
    unknown = [p for p in getattr(args, "cache_transfer_protocol", ()) if p not in ("ipc", "tcp", "rdma")]
    if unknown:
        lines.append(f"--cache-transfer-protocol {','.join(unknown)}: not available; pdserve offers ipc (same host), "
                     "tcp (any host) and rdma (NIXL)")
    if not lines:
        for f in unneeded:
            log.info("%s accepted, not needed: %s", f.name, f.unneeded)
    return lines
