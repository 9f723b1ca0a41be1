"""The engine flags shared by `pdserve generate`, `serve` and `launch`: generated from EngineConfig's fields."""

from __future__ import annotations

import argparse

from pdserve.config.engine import EngineConfig
from pdserve.config.flags import add_flags, from_args


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, EngineConfig)


def engine_config_from_args(args: argparse.Namespace, **extra: object) -> EngineConfig:
    return from_args(EngineConfig, args, **extra)
