"""Linear layers as the forward pass calls them: dense (any dtype, any device) or int8 (CPU).

`--quantization w8a8` is opt-in and not exact: weights become int8 per output channel, and each
call quantizes its activations dynamically (fbgemm's `linear_dynamic`, with reduced range against
int16 overflow on AVX2). It cuts the weight bytes 4x, so both the memory-bound batch-1 decode and the
compute-bound large batches run faster on CPU. The decoder keeps its down projection dense (see
DecoderLayer.build_linears).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.quantized.linear_dynamic(x.float(), self.packed, True)
        return out if self.out_dtype == torch.float32 else out.to(self.out_dtype)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return residual.add_(self(x))


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None
                ) -> DenseLinear | Int8Linear:
    if quantization is None:
        return DenseLinear(weight, bias)
    if quantization == "w8a8":
        return Int8Linear(weight, bias)
    raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATION_METHODS)}")
