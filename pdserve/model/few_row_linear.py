"""The few-row path of a packed linear: pdserve's kernel reading oneDNN's packed weight for a few rows.

A decode step of a few sequences is a read of the weights; oneDNN's matmul read them at ~30 GB/s on a 2-core
AVX-512 box where the kernel streams them at the box's read bandwidth (~58). Up to max_rows(dtype) rows; past
them oneDNN's blocking pays. The kernel reads oneDNN's own packed copy, so there is one copy of each weight.
That layout is oneDNN's choice, so it is read from a packed probe, and the kernel is checked against oneDNN's
result on each weight shape before it is used: a layout it does not know leaves that shape on oneDNN, said
once in the log.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Any

import torch

from pdserve.utils.cpu_features import cpu_flags

log = logging.getLogger("pdserve.model")

_SLICE = 64  # outputs per task in the kernel: a block must be whole slices
_DISABLE_ENV = "PDSERVE_DISABLE_FEW_ROW_LINEAR"  # "1": every call goes to oneDNN (comparisons)
_PROBE = 256


def _ops() -> Any | None:
    if os.environ.get(_DISABLE_ENV) == "1":
        return None
    from pdserve.kernels import cpu_ops

    return cpu_ops()


def _raw_packed(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of the packed tensor's bytes, as `dtype` values in storage order."""
    nbytes = torch.ops.mkldnn._nbytes(packed)
    address = torch.ops.mkldnn.data_ptr(packed)
    buffer = (ctypes.c_char * nbytes).from_address(address)
    return torch.frombuffer(bytearray(buffer), dtype=dtype)


def max_rows(dtype: torch.dtype) -> int:
    """Rows up to which the kernel beat oneDNN (same run, 30 layers of SmolLM2-135M's linears, AVX-512 box
    without AMX): bf16 1.35-1.6x at 1-12 rows, 1.1-1.2x at 16-32, even at 48; fp32 1.2-1.5x at 1-12, 1.1x at
    16, even at 24; built for AVX2 (8-float vectors) fp32 1.4-1.56x at 1-8 rows, even at 16. Where AMX
    multiplies oneDNN's tiles (unmeasured here) bf16 stops at 8."""
    if dtype == torch.bfloat16:
        return 8 if "amx_bf16" in cpu_flags() else 32
    from pdserve.kernels import ISA_ENV

    wide = "avx512f" in cpu_flags() and os.environ.get(ISA_ENV, "native") == "native"
    return 16 if wide else 8


@functools.cache
def packed_block(dtype: torch.dtype) -> int | None:
    """NB of oneDNN's [N / NB][K / P][NB][P] layout for `dtype`, read from a packed probe; None when the
    kernel cannot run this dtype here or the probe is laid out otherwise."""
    ops = _ops()
    if ops is None or not ops.few_row_linear_supports(str(dtype).removeprefix("torch.")):
        return None
    pair = 2 if dtype == torch.bfloat16 else 1
    rows = torch.arange(_PROBE, dtype=torch.float32)
    outputs = _raw_packed(torch.ops.mkldnn._reorder_linear_weight(
        rows.view(-1, 1).expand(_PROBE, _PROBE).to(dtype).contiguous(), 64), dtype).long()
    inputs = _raw_packed(torch.ops.mkldnn._reorder_linear_weight(
        rows.view(1, -1).expand(_PROBE, _PROBE).to(dtype).contiguous(), 64), dtype).long()
    if outputs.numel() != _PROBE * _PROBE:
        return None
    first_past = (inputs >= pair).nonzero()
    block = int(first_past[0]) // pair if first_past.numel() else 0
    if block == 0 or block % _SLICE or _PROBE % block:
        return None
    i = torch.arange(_PROBE * _PROBE)
    expect_out = i // (_PROBE * block) * block + i // pair % block
    expect_in = i // (pair * block) % (_PROBE // pair) * pair + i % pair
    if not (torch.equal(outputs, expect_out) and torch.equal(inputs, expect_in)):
        return None
    return block


class FewRowPath:
    """The kernel call for one packed weight, or None from `for_weight` where it cannot be used."""

    def __init__(self, ops: Any, packed: torch.Tensor, n: int, block: int, bias: torch.Tensor | None) -> None:
        self.ops, self.packed, self.n, self.block, self.bias = ops, packed, n, block, bias
        self.dtype = packed.dtype  # the kernel reads the weight as x's dtype: the caller checks they agree
        self.max_rows = max_rows(packed.dtype)
        self.address = torch.ops.mkldnn.data_ptr(packed)  # `packed` is kept alive by this object

    @classmethod
    def for_weight(cls, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> FewRowPath | None:
        n, k = weight.shape
        block = packed_block(weight.dtype)
        ops = _ops()
        if block is None or ops is None or n % block or k % 2 or torch.ops.mkldnn._nbytes(packed) != \
                weight.numel() * weight.element_size():
            return None
        path = cls(ops, packed, n, block, bias)
        return path if _agrees(path, packed, weight, bias) else None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.ops.few_row_linear(x, self.address, self.n, self.block, self.bias, residual)


_verdicts: dict[tuple[torch.dtype, int, int, bool], bool] = {}


def _agrees(path: FewRowPath, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The kernel's answer equals oneDNN's on this weight's shape (within rounding): a misread layout would
    not. The layout depends on the shape alone, so each shape is checked once."""
    key = (weight.dtype, *weight.shape, bias is not None)
    if key in _verdicts:
        return _verdicts[key]
    ok = _verdicts[key] = _shape_agrees(path, packed, weight, bias)
    if not ok:
        log.warning("the few-row linear kernel disagrees with oneDNN on a %s weight of shape %s; that shape "
                    "stays on oneDNN", weight.dtype, tuple(weight.shape))
    return ok


def _shape_agrees(path: FewRowPath, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, weight.shape[1], generator=generator).to(weight.dtype)
    residual = torch.randn(3, weight.shape[0], generator=generator).to(weight.dtype)
    want = torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add").float()
    got = path(x, residual).float()
    tolerance = 1e-2 if weight.dtype == torch.bfloat16 else 1e-4
    return bool((got - want).abs().max() <= tolerance * (want.abs().max() + 1))


def describe(dtype: torch.dtype, paths: list[FewRowPath | None]) -> str:
    """One line for the start-up log: which linears take the kernel, up to how many rows, or why none does."""
    used = sum(path is not None for path in paths)
    if used:
        return (f"few-row linear kernel for 1-{max_rows(dtype)} rows on {used} of {len(paths)} packed linears "
                f"({dtype}, oneDNN blocks of {packed_block(dtype)}); more rows on oneDNN")
    if os.environ.get(_DISABLE_ENV) == "1":
        return f"few-row linear kernel off ({_DISABLE_ENV}=1): every linear on oneDNN"
    if _ops() is None:
        return "few-row linear kernel off (pdserve's kernels are not built): every linear on oneDNN"
    if packed_block(dtype) is None:
        return f"few-row linear kernel off for {dtype} (no kernel for it in this build, or an unknown oneDNN layout)"
    return "few-row linear kernel off: it disagreed with oneDNN on every weight shape"
