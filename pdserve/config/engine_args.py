"""The engine flags shared by `pdserve generate`, `serve` and `launch`: generated from EngineConfig's fields."""

from __future__ import annotations

import argparse

from pdserve.config.engine import EngineConfig
from pdserve.config.flags import add_flags, from_args


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, EngineConfig)


def engine_config_from_args(args: argparse.Namespace, **extra: object) -> EngineConfig:
    """The config of data-parallel rank 0 (--pd-comm-port's first port; `pdserve serve` gives the others theirs)."""
    ports = getattr(args, "pd_comm_port", None)
    if isinstance(ports, list) and "pd_comm_port" not in extra:
        extra["pd_comm_port"] = ports[0]
    return from_args(EngineConfig, args, **extra)
