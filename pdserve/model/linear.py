"""Linear layers as the forward pass calls them: packed oneDNN (CPU), dense (any device) or int8 (CPU).

On CPU the weight is reordered once into oneDNN's blocked layout and every call goes straight to
oneDNN's matmul, as vLLM's CPU backend does. Measured on the AVX-512 box (2 threads, SmolLM2 shapes):
bf16 1.1-1.2x F.linear at 64-512 rows and 2x at one row; fp32 1.4-2x at 1-64 rows.

`--quantization w8a8` is opt-in and not exact: weights become int8 per output channel, and each
call quantizes its activations dynamically (fbgemm's `linear_dynamic`). Without VNNI, fbgemm multiplies
through saturating int16 sums, so activations get 7 bits (reduce_range); with VNNI (avx512_vnni,
avx_vnni) the sums are int32 and activations keep all 8 bits. On the AVX-512 box 7 bits cost the
embedded model 3-6 of 48 teacher-forced next tokens against fp32 (38-41/48 -> 41-44/48). int8 cuts
the weight bytes 4x, so both the memory-bound batch-1 decode and the compute-bound large batches run
faster on CPU. The decoder keeps its down projection dense (see DecoderLayer.build_linears).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from pdserve.model.few_row_linear import FewRowPath
from pdserve.utils.cpu_features import has_vnni

QUANTIZATION_METHODS = ("w8a8",)


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ W.T (+ bias), the add fused into the matmul."""
        out = torch.addmm(residual, x, self.weight.t())
        return out if self.bias is None else out.add_(self.bias)


class PackedLinear:
    """oneDNN's packed matmul; a few rows (a decode step of few sequences) through pdserve's kernel over the
    same packed weight where it runs here (model/few_row_linear.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)  # 64: rows it is tuned for
        self.bias = bias
        self.nbytes = weight.numel() * weight.element_size()
        self.few_rows = FewRowPath.for_weight(self.packed, weight.detach(), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._few_rows(x):
            return self.few_rows(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self._few_rows(x) and residual.is_contiguous():
            return self.few_rows(x, residual)
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")

    def _few_rows(self, x: torch.Tensor) -> bool:
        few = self.few_rows
        return (few is not None and x.dim() == 2 and x.shape[0] <= few.max_rows and x.dtype == few.dtype
                and x.is_contiguous())


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() or weight.numel() == 0:
        return False
    if weight.dtype == torch.bfloat16:  # oneDNN's bf16 matmul needs AVX-512 (or AMX); elsewhere F.linear
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


class Int8Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight.device.type != "cpu":
            raise ValueError("--quantization w8a8 runs on CPU only")
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8).double()
        with warnings.catch_warnings():  # torch marks quantized tensors deprecated; fbgemm still needs them
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(w, scales, torch.zeros_like(scales, dtype=torch.long), 0,
                                                 torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())
        self.out_dtype = weight.dtype
        self.nbytes = weight.numel()  # one byte per weight
        self.reduce_range = not has_vnni()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.quantized.linear_dynamic(x.float(), self.packed, self.reduce_range)
        return out if self.out_dtype == torch.float32 else out.to(self.out_dtype)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return residual.add_(self(x))


Linear = DenseLinear | PackedLinear | Int8Linear


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None) -> Linear:
    if quantization is None:
        return PackedLinear(weight, bias) if can_pack(weight) else DenseLinear(weight, bias)
    if quantization == "w8a8":
        return Int8Linear(weight, bias)
    raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATION_METHODS)}")
