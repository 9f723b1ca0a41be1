"""Sampling: the request's parameters (torch-free, every process) and the sampler (the worker's, torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.sampling.sampling_params import SamplingParams
from pdserve.sampling.stop import check_stop

if TYPE_CHECKING:
    from pdserve.sampling.sampler import Sampler, SamplerOutput, SamplingRow, make_generator, skip_draws

__all__ = ["SamplingParams", "Sampler", "SamplingRow", "SamplerOutput", "check_stop", "make_generator", "skip_draws"]
_SAMPLER_NAMES = {"Sampler", "SamplingRow", "SamplerOutput", "make_generator", "skip_draws"}


def __getattr__(name: str) -> Any:
    if name in _SAMPLER_NAMES:
        from pdserve.sampling import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module 'pdserve.sampling' has no attribute {name!r}")
