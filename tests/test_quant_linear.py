"""The GGUF block-format kernel against dequantize-then-matmul, for every format it takes.

The reference is gguf-py's own dequantizer on the same bytes, so a misread format (a nibble order, a K-quant's
6-bit scales) fails here. The kernel quantizes activations per block to int8, so it matches within about 1% of the
output's scale; at 1..64 rows (the decode sizes and a prefill's), odd shapes, bias and the residual add, bf16 and
fp32, and built for AVX2 too where this box has AVX-512.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pdserve.kernels import ISA_ENV, cpu_ops
from pdserve.loader.gguf_blocks import FORMATS, from_gguf, quantize

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="pdserve's kernels are not built here")

# (outputs, inputs): SmolLM2-135M's qkv, an odd width (48 outputs: three row groups; 288 inputs: 9 blocks of 32,
# one K-quant super-block and a part), and a wide one
SHAPES = [(960, 576), (48, 288), (160, 1024)]
TOLERANCE = 0.012  # of the reference's largest output: int8 activations (and a bf16 output)


def raw_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random, well-formed blocks of format `name`: random bytes with sane fp16 scales written over them."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    block, size = GGML_QUANT_SIZES[T[name]]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)

    def put(at: int, low: float, high: float) -> None:
        raw[:, at:at + 2] = rng.uniform(low, high, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)

    at = {"Q6_K": 208}.get(name, 0)
    put(at, 0.001, 0.01) if not name.endswith("_K") else put(at, 0.0001, 0.001)
    if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
        put(2, -0.05, 0.0) if not name.endswith("_K") else put(2, 0.0001, 0.001)
    if name == "Q8_0":
        codes = raw[:, 2:]
        codes[codes == 128] = 129  # -128: llama.cpp never writes it (the AVX2 kernel reads Q8_0 codes as signed)
    return raw.reshape(rows, -1)


def matrix_and_reference(name: str, rows: int, cols: int, seed: int = 0):
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    raw = raw_blocks(name, rows, cols, np.random.default_rng(seed))
    reference = torch.from_numpy(np.asarray(dequantize(raw, T[name]), dtype=np.float32).reshape(rows, cols))
    return from_gguf(name, raw, (rows, cols)), reference


def shapes_for(name: str) -> list[tuple[int, int]]:
    return [s for s in SHAPES if s[1] % (256 if name.endswith("_K") else 32) == 0]


@pytest.mark.parametrize("name", list(FORMATS))
def test_codes_dequantize_as_gguf_does(name):
    """Exact for the 32-element formats; the K-quants' scale products are rounded to fp16 once."""
    matrix, reference = matrix_and_reference(name, 64, 512)
    error = float(np.abs(matrix.dequantize() - reference.numpy()).max() / reference.abs().max())
    assert error <= (1e-3 if name.endswith("_K") else 0.0), error


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_count_matches_dequantized_matmul(name, dtype):
    from pdserve.model.quantized_linear import QuantLinear

    g = torch.Generator().manual_seed(3)
    for n, k in shapes_for(name):
        matrix, weight = matrix_and_reference(name, n, k)
        bias = torch.randn(n, generator=g).to(dtype)
        linear, biased = QuantLinear(matrix, None), QuantLinear(matrix, bias)
        for rows in [*range(1, 18), 31, 64]:
            x = torch.randn(rows, k, generator=g).to(dtype)
            residual = torch.randn(rows, n, generator=g).to(dtype)
            want = x.float() @ weight.t()
            added = want + bias.float() + residual.float()
            for got, expect in ((linear(x), want), (biased.add_to(residual, x), added)):
                assert got.dtype == dtype and got.shape == (rows, n)
                scale = float(expect.abs().max())
                error = float((got.float() - expect).abs().max())
                assert error <= TOLERANCE * scale, (name, n, k, rows, error / scale)


@pytest.mark.parametrize("name", list(FORMATS))
def test_row_lookup_is_the_dequantized_row(name):
    """The embedding lookup of a packed token table (no int8 step: exact up to the K-quants' fp16 scales)."""
    from pdserve.model.quantized_linear import QuantLinear

    matrix, weight = matrix_and_reference(name, 96, 256)
    ids = torch.tensor([[0, 17, 95], [3, 3, 64]])
    got = QuantLinear(matrix, None).rows(ids, torch.float32)
    assert got.shape == (2, 3, 256)
    assert torch.allclose(got, weight[ids], atol=1e-3 * float(weight.abs().max()), rtol=0)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
def test_quantizing_at_load_keeps_the_weights_close(name):
    """--quantization q8_0 / q4_0 on a Hugging Face folder: round to nearest per block of 32."""
    w = np.random.default_rng(1).standard_normal((32, 256)).astype(np.float32)
    error = np.abs(quantize(w, name).dequantize() - w).max()
    assert error <= {"Q8_0": 0.5 / 127, "Q4_0": 1.0 / 8}[name] * np.abs(w).max() * 1.01


AVX2_SCRIPT = """
import torch
from tests.test_quant_linear import FORMATS, test_every_row_count_matches_dequantized_matmul
for name in FORMATS:
    for dtype in (torch.float32, torch.bfloat16):
        test_every_row_count_matches_dequantized_matmul(name, dtype)
print("ok")
"""


@pytest.mark.skipif("avx512f" not in open("/proc/cpuinfo").read(),
                    reason="this machine is AVX2 already: every other test here ran the AVX2 build")
def test_an_avx2_build_gives_the_same_answers():
    env = {**os.environ, ISA_ENV: "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    proc = subprocess.run([sys.executable, "-c", AVX2_SCRIPT], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
