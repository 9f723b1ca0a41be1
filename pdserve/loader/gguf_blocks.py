"""GGUF's quantized tensors as codes, scales and mins: the one shape every block format takes before packing.

Each supported format is, block by block, an affine map of small unsigned codes: w = scale * code + min over
`group` consecutive inputs of one output row. A format without a stored min has a fixed one, -offset * scale.
The K-quants' two-level scales (a super-block's fp16 d times a sub-block's 6- or 8-bit integer) are multiplied
out here and kept as fp16, as the 32-element formats store theirs: a relative rounding of at most 2^-11 on a
block's scale, far below the 4-6 bit codes' own step. Codes are one uint8 per weight here; the packer gives each
the bits of its format. Nothing here is widened to floats, except by `dequantize`, the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockFormat:
    name: str  # the GGUF type the codes came from (Q4_0 ...)
    bits: int  # bits a code takes in the packed weight: 4, 5, 6 or 8
    group: int  # inputs per scale
    offset: int  # without mins: w = scale * (code - offset)
    has_min: bool  # w = scale * code + min

    def same_kernel(self, other: BlockFormat) -> bool:
        return (self.bits, self.group, self.offset, self.has_min) == (other.bits, other.group, other.offset,
                                                                     other.has_min)


FORMATS = {
    "Q4_0": BlockFormat("Q4_0", 4, 32, 8, False),
    "Q4_1": BlockFormat("Q4_1", 4, 32, 0, True),
    "Q5_0": BlockFormat("Q5_0", 5, 32, 16, False),
    "Q5_1": BlockFormat("Q5_1", 5, 32, 0, True),
    "Q8_0": BlockFormat("Q8_0", 8, 32, 128, False),
    "Q4_K": BlockFormat("Q4_K", 4, 32, 0, True),
    "Q5_K": BlockFormat("Q5_K", 5, 32, 0, True),
    "Q6_K": BlockFormat("Q6_K", 6, 16, 32, False),
}


@dataclass
class QuantizedMatrix:
    """A [rows, cols] weight as codes (uint8, one per weight), fp16 scales and (has_min) fp16 mins per block."""

    fmt: BlockFormat
    codes: np.ndarray  # uint8 [rows, cols]
    scales: np.ndarray  # float16 [rows, cols // group]
    mins: np.ndarray | None  # float16 [rows, cols // group]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # type: ignore[return-value]

    def __getitem__(self, index: slice | tuple[slice, slice]) -> QuantizedMatrix:
        """m[rows] or m[:, columns], as a tensor-parallel rank takes its share."""
        if isinstance(index, tuple):
            rows, columns = index
            return self.rows(rows).columns(columns)
        return self.rows(index)

    def rows(self, part: slice) -> QuantizedMatrix:
        return QuantizedMatrix(self.fmt, self.codes[part], self.scales[part],
                               None if self.mins is None else self.mins[part])

    def columns(self, part: slice) -> QuantizedMatrix:
        """Inputs `part` (whole blocks only: a tensor-parallel rank's share of a row-parallel weight)."""
        start, stop, _ = part.indices(self.shape[1])
        g = self.fmt.group
        if start % g or stop % g:
            raise ValueError(f"columns {start}:{stop} are not whole blocks of {g}")
        blocks = slice(start // g, stop // g)
        return QuantizedMatrix(self.fmt, self.codes[:, part], self.scales[:, blocks],
                               None if self.mins is None else self.mins[:, blocks])

    def permute_rows(self, order: np.ndarray) -> QuantizedMatrix:
        return QuantizedMatrix(self.fmt, self.codes[order], self.scales[order],
                               None if self.mins is None else self.mins[order])

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols]: the reference the kernels are checked against."""
        rows, cols = self.shape
        g = self.fmt.group
        codes = self.codes.reshape(rows, cols // g, g).astype(np.float32)
        scales = self.scales.astype(np.float32)[..., None]
        mins = -self.fmt.offset * scales if self.mins is None else self.mins.astype(np.float32)[..., None]
        return (codes * scales + mins).reshape(rows, cols)


def concat_rows(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
    fmt = parts[0].fmt
    if any(not p.fmt.same_kernel(fmt) for p in parts):
        raise ValueError("rows of different block formats cannot be one packed weight")
    mins = None if not fmt.has_min else np.concatenate([p.mins for p in parts])  # type: ignore[misc]
    return QuantizedMatrix(fmt, np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                           mins)


def from_gguf(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedMatrix:
    """A GGUF tensor's bytes ([rows, bytes per row], uint8) as codes, scales and mins."""
    rows, cols = shape
    decode = _DECODERS[type_name]
    fmt = FORMATS[type_name]
    blocks = np.ascontiguousarray(raw).reshape(rows * cols // _SUPER[type_name], -1)
    codes, scales, mins = decode(blocks)
    return QuantizedMatrix(fmt, codes.reshape(rows, cols), scales.reshape(rows, cols // fmt.group),
                           None if mins is None else mins.reshape(rows, cols // fmt.group))


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes of a 32-element block -> [n, 32] codes: low nibbles first, then high (GGUF's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """[n, 4] bytes (a little-endian uint32 of one bit per element) -> [n, count] bits."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[:, :count]


def _q4_0(b: np.ndarray) -> tuple:
    return _nibbles(b[:, 2:]), _f16(b[:, :2]), None


def _q4_1(b: np.ndarray) -> tuple:
    return _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> tuple:
    return _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6], 32) << 4), _f16(b[:, :2]), None


def _q5_1(b: np.ndarray) -> tuple:
    return _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8], 32) << 4), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> tuple:
    # codes + 128, never 0: the AVX2 kernel takes Q8_0 codes as signed in [-127, 127] (llama.cpp writes no -128)
    codes = (b[:, 2:].view(np.int8).astype(np.int16) + 128).clip(1, 255).astype(np.uint8)
    return codes, _f16(b[:, :2]), None


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per 32-element sub-block, scale d * sc and min -dmin * m (fp32), from the 12 packed bytes."""
    d = _f16(b[:, :2]).astype(np.float32)
    dmin = _f16(b[:, 2:4]).astype(np.float32)
    s = b[:, 4:16].reshape(-1, 3, 4)
    lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 128] bytes -> [n, 256] codes: each 32 bytes give a sub-block of low nibbles, then one of high."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> tuple:
    scales, mins = _k_scales(b)
    return _k_nibbles(b[:, 16:]), scales.astype(np.float16), mins.astype(np.float16)


def _q5_k(b: np.ndarray) -> tuple:
    scales, mins = _k_scales(b)
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return _k_nibbles(b[:, 48:]) | (high.reshape(-1, 256) << 4), scales.astype(np.float16), mins.astype(np.float16)


def _q6_k(b: np.ndarray) -> tuple:
    ql = (b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = ql.reshape(-1, 256) | (qh.reshape(-1, 256) << 4)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210]).astype(np.float32)
    return codes, (d * sc).astype(np.float16), None


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k,
             "Q5_K": _q5_k, "Q6_K": _q6_k}
_SUPER = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}


def quantize(weight: np.ndarray, type_name: str) -> QuantizedMatrix:
    """A float [rows, cols] weight quantized round-to-nearest per block, as llama.cpp's reference quantizers do
    (Q8_0: scale max|w| / 127; Q4_0: the block's largest-magnitude value maps to code 0)."""
    rows, cols = weight.shape
    if type_name not in ("Q8_0", "Q4_0") or cols % 32:
        raise ValueError(f"quantize at load: Q8_0 or Q4_0, columns a multiple of 32 (got {type_name}, {cols})")
    blocks = weight.astype(np.float32).reshape(rows, cols // 32, 32)
    if type_name == "Q8_0":
        d = (np.abs(blocks).max(axis=-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        codes = (np.rint(blocks * inv).clip(-127, 127) + 128).astype(np.uint8)
    else:
        at = np.abs(blocks).argmax(axis=-1)[..., None]
        d = (np.take_along_axis(blocks, at, axis=-1) / -8).astype(np.float16).astype(np.float32)
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        codes = np.trunc(blocks * inv + 8.5).clip(0, 15).astype(np.uint8)
    return QuantizedMatrix(FORMATS[type_name], codes.reshape(rows, cols), d[..., 0].astype(np.float16), None)
