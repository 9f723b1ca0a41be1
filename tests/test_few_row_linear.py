"""The few-row linear kernel (a decode step's linears over oneDNN's packed weight) against fp32 matmuls.

Every row count it takes, with and without bias and the residual add, in bf16 and fp32; a wrong reading of
oneDNN's layout must be refused, not used; and a build for AVX2 (8-float vectors) gives the same answers.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from pdserve.kernels import ISA_ENV, cpu_ops
from pdserve.model import few_row_linear
from pdserve.model.few_row_linear import FewRowPath, max_rows, packed_block
from pdserve.model.linear import PackedLinear, can_pack
from pdserve.utils.cpu_features import cpu_flags

SHAPES = [(960, 576), (576, 1536), (3072, 576)]  # SmolLM2-135M's qkv, down, gate|up


def dtypes() -> list[torch.dtype]:
    """The dtypes whose kernel runs here: built for this CPU, and oneDNN's packed layout one the probe reads (an
    AMX box's oneDNN may pack otherwise; the kernel then stays off, which test_the_start_up_line_says_what_runs
    covers)."""
    wanted = [torch.float32, torch.bfloat16]
    return [d for d in wanted if cpu_ops() is not None and can_pack(torch.empty(1, dtype=d))
            and cpu_ops().few_row_linear_supports(str(d).removeprefix("torch.")) and packed_block(d) is not None]


def tolerance(dtype: torch.dtype, reference: torch.Tensor) -> float:
    # bf16: the output is rounded to 8 bits of mantissa, and the inputs were bf16 already
    return (2e-2 if dtype == torch.bfloat16 else 1e-4) * (float(reference.abs().max()) + 1)


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_row_count_matches_fp32(dtype, shape, with_bias):
    g = torch.Generator().manual_seed(1)
    n, k = shape
    weight = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    linear = PackedLinear(weight, bias)
    assert linear.few_rows is not None, "the kernel should take this shape here"
    for rows in range(1, max_rows(dtype) + 2):  # one past the limit: oneDNN's path, same answer
        x = torch.randn(rows, k, generator=g).to(dtype)
        residual = torch.randn(rows, n, generator=g).to(dtype)
        want = x.float() @ weight.float().t() + (0 if bias is None else bias.float())
        for got, expect in ((linear(x), want), (linear.add_to(residual, x), want + residual.float())):
            assert got.dtype == dtype and got.shape == (rows, n)
            assert (got.float() - expect).abs().max() <= tolerance(dtype, expect), rows
        if rows <= max_rows(dtype):  # the kernel itself, not a fallback, gave that answer
            direct = linear.few_rows(x, residual).float()
            assert (direct - want - residual.float()).abs().max() <= tolerance(dtype, want)


@pytest.mark.parametrize("dtype", dtypes())
def test_strided_input_goes_to_onednn_with_the_same_answer(dtype):
    weight = torch.randn(576, 576).to(dtype) * 0.05
    linear = PackedLinear(weight, None)
    wide = torch.randn(2, 2 * 576).to(dtype)
    x = wide[:, :576]  # not contiguous: the kernel is not asked
    want = x.float() @ weight.float().t()
    assert (linear(x).float() - want).abs().max() <= tolerance(dtype, want)


@pytest.mark.parametrize("dtype", dtypes())
def test_a_misread_layout_is_refused_and_logged(dtype, monkeypatch, caplog):
    weight = torch.randn(1024, 576).to(dtype) * 0.05
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    wrong = 2 * packed_block(dtype)  # a layout oneDNN did not use
    monkeypatch.setattr(few_row_linear, "packed_block", lambda _dtype: wrong)
    monkeypatch.setattr(few_row_linear, "_verdicts", {})
    with caplog.at_level(logging.WARNING, logger="pdserve.model"):
        assert FewRowPath.for_weight(packed, weight, None) is None
    assert "disagrees with oneDNN" in caplog.text


def test_the_probe_reads_onednns_layout_on_the_cpus_it_was_measured_on():
    flags = cpu_flags()
    if "avx2" not in flags:
        pytest.skip("measured on x86 boxes with AVX2 or AVX-512 only")
    assert packed_block(torch.float32) == 64  # blocks of 64 outputs, inputs one by one
    if "avx512_bf16" in flags and "amx_bf16" not in flags:
        assert packed_block(torch.bfloat16) == 64  # blocks of 64 outputs, inputs in pairs


def test_the_start_up_line_says_what_runs(monkeypatch):
    if not dtypes():
        pytest.skip("the kernel runs for no dtype here")
    dtype = dtypes()[0]
    paths = [PackedLinear(torch.randn(576, 576).to(dtype), None).few_rows for _ in range(2)]
    assert few_row_linear.describe(dtype, paths).startswith(f"few-row linear kernel for 1-{max_rows(dtype)} rows "
                                                             "on 2 of 2")
    monkeypatch.setenv("PDSERVE_DISABLE_FEW_ROW_LINEAR", "1")
    assert "off (PDSERVE_DISABLE_FEW_ROW_LINEAR=1)" in few_row_linear.describe(dtype, [None])


AVX2_SCRIPT = """
import torch
from pdserve.kernels import cpu_ops
from pdserve.model.linear import PackedLinear
from pdserve.model.few_row_linear import max_rows
assert not cpu_ops().few_row_linear_supports("bfloat16"), "an AVX2 build has no bf16 dot products"
g = torch.Generator().manual_seed(2)
w = torch.randn(960, 576, generator=g) * 0.05
lin = PackedLinear(w, None)
assert lin.few_rows is not None and max_rows(torch.float32) == 8
for rows in range(1, 10):
    x = torch.randn(rows, 576, generator=g)
    err = (lin(x) - x @ w.t()).abs().max().item()
    assert err < 1e-4, (rows, err)
print("ok")
"""


@pytest.mark.e2e  # builds the kernels a second time (~20-40 s, cached afterwards)
def test_an_avx2_build_gives_the_same_answers():
    if "avx512f" not in open("/proc/cpuinfo").read():
        pytest.skip("this machine is AVX2 already: every other test here ran the AVX2 build")
    env = {**os.environ, ISA_ENV: "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    proc = subprocess.run([sys.executable, "-c", AVX2_SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_an_input_of_another_dtype_goes_to_onednn():
    if torch.bfloat16 not in dtypes():
        pytest.skip("no bf16 kernel here")
    weight = torch.randn(576, 576).to(torch.bfloat16) * 0.05
    linear = PackedLinear(weight, None)
    assert not linear._few_rows(torch.randn(1, 576))  # fp32 rows against a bf16 weight: not the kernel's
