"""Linears on GGUF's block formats: the codes packed once for pdserve's kernel, multiplied as they are.

A weight arrives as a QuantizedMatrix (loader/gguf_blocks.py: codes, fp16 scales and mins per block) and is
laid out for kernels/csrc/quant_linear.cpp: groups of 16 output rows, one record per input block (scales, mins,
codes interleaved 16 rows by 4 inputs). Every call quantizes its activations per block to int8 and multiplies
bytes (VNNI's vpdpbusd on AVX-512, vpmaddubsw on AVX2), at any row count: a decode step streams the packed weight
once, a prefill re-reads a group's few kilobytes from cache for every 8 rows.

Where the kernel cannot run (not built, a CUDA device, rows not a multiple of 16), the weight is dequantized
to the model's dtype at load and the layer runs as a dense one; the log says which and why.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pdserve.loader.gguf_blocks import QuantizedMatrix, concat_rows

GROUP_ROWS = 16


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.require(a, requirements=["C", "W"]))


def pack(matrix: QuantizedMatrix) -> torch.Tensor:
    """The kernel's layout of `matrix`, as flat uint8."""
    n, k = matrix.shape
    f = matrix.fmt
    groups, blocks = n // GROUP_ROWS, k // f.group
    codes = _tensor(matrix.codes)
    parts = [_per_block(matrix.scales, groups, blocks)]
    if f.has_min:
        parts.append(_per_block(matrix.mins, groups, blocks))  # type: ignore[arg-type]
    if f.bits == 8:  # [group][block][4-input chunk][row][4]
        q = codes.view(groups, GROUP_ROWS, blocks, f.group // 4, 4).permute(0, 2, 3, 1, 4)
        parts.append(q.reshape(groups, blocks, -1))
    else:  # a chunk's low nibbles: inputs 4j..4j+3, high nibbles: the same half a block further; then bit planes
        c = codes.view(groups, GROUP_ROWS, blocks, 2, f.group // 8, 4)
        q = ((c[:, :, :, 0] & 0x0F) | ((c[:, :, :, 1] & 0x0F) << 4)).permute(0, 2, 3, 1, 4)
        parts.append(q.reshape(groups, blocks, -1))
        parts += [_bit_plane(c, bit) for bit in range(4, f.bits)]
    return torch.cat(parts, dim=2).reshape(-1)


def _bit_plane(c: torch.Tensor, bit: int) -> torch.Tensor:
    """Bit `bit` of every code [group][row][block][half][chunk][4] as the kernel's masks: per block, per chunk and
    nibble half, 64 bits (little-endian), bit 4r + i for row r's input i of the chunk."""
    bits = ((c >> bit) & 1).permute(0, 2, 4, 3, 1, 5)  # [group][block][chunk][half][row][4]
    groups, blocks = bits.shape[:2]
    packed = np.packbits(bits.reshape(groups, blocks, -1, 64).numpy(), axis=-1, bitorder="little")
    return torch.from_numpy(packed.reshape(groups, blocks, -1))


def _per_block(values: np.ndarray, groups: int, blocks: int) -> torch.Tensor:
    """fp16 [rows, blocks] -> bytes [group][block][16 rows' values]."""
    t = _tensor(values.astype(np.float16, copy=False)).view(groups, GROUP_ROWS, blocks).permute(0, 2, 1)
    return t.contiguous().view(torch.uint8)


def _kernels() -> Any | None:
    from pdserve.kernels import cpu_ops

    return cpu_ops()


def kernel_refusal(matrix: QuantizedMatrix, device: torch.device) -> str | None:
    """Why this weight cannot run packed here (None: it can)."""
    if device.type != "cpu":
        return f"no {device.type} kernel for GGUF block formats yet"
    if matrix.shape[0] % GROUP_ROWS:
        return f"{matrix.shape[0]} outputs is not a multiple of {GROUP_ROWS}"
    if _kernels() is None:
        return "pdserve's kernels are not built"
    return None


class QuantLinear:
    """x @ W.T (+ bias) with W packed; also W's rows for an embedding lookup."""

    def __init__(self, matrix: QuantizedMatrix, bias: torch.Tensor | None) -> None:
        self.fmt = matrix.fmt
        self.n, self.k = matrix.shape
        self.packed = pack(matrix)
        self.bias = bias
        self.nbytes = self.packed.numel()
        self.ops = _kernels()
        f = self.fmt
        self._format = (f.bits, f.group, f.offset, f.has_min)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, self.k).contiguous()
        if residual is not None:
            residual = residual.reshape(-1, self.n).contiguous()
        out = self.ops.quant_linear(flat, self.packed, self.n, *self._format, self.bias, residual)
        return out.view(*x.shape[:-1], self.n)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self(x, residual)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """W[ids] as `dtype` [len(ids), k]: the embedding lookup of a quantized token table."""
        flat = ids.reshape(-1).to(torch.long)
        out = self.ops.quant_dequantize(self.packed, self.n, self.k, *self._format, flat, dtype)
        return out.view(*ids.shape, self.k)

    def describe(self) -> str:
        return self.fmt.name


class ConcatLinear:
    """Fused projections whose parts came in different block formats (Q4_K_M files quantize q, k and v
    differently): each part runs its own kernel, the outputs side by side."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        self.parts = parts
        self.nbytes = sum(p.nbytes for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return residual + self(x)

    def describe(self) -> str:
        return "+".join(p.fmt.name for p in self.parts)


def quantized_linear(parts: list[QuantizedMatrix], bias: torch.Tensor | None) -> QuantLinear | ConcatLinear:
    """One linear over `parts` stacked by rows (q|k|v, gate|up); the caller checked kernel_refusal on each."""
    runs: list[list[QuantizedMatrix]] = []  # neighbours of one kernel format packed as one matrix
    for p in parts:
        if runs and runs[-1][0].fmt.same_kernel(p.fmt):
            runs[-1].append(p)
        else:
            runs.append([p])
    merged = [concat_rows(run) if len(run) > 1 else run[0] for run in runs]
    if len(merged) == 1:
        return QuantLinear(merged[0], bias)
    linears, start = [], 0
    for m in merged:
        part_bias = None if bias is None else bias[start:start + m.shape[0]]
        linears.append(QuantLinear(m, part_bias))
        start += m.shape[0]
    return ConcatLinear(linears)
