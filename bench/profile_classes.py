"""Op classes of a profiled forward step, by the op's name, for pdserve's and vLLM's CPU kernels alike
(bench/step_profile.py and bench/peers/vllm_step_profile.py, which runs under vLLM's Python: no pdserve here)."""

from __future__ import annotations

CLASSES = ["linears", "logits", "attention", "small ops", "sampling", "other"]

_LINEAR = ("_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm",
           "onednn_mm", "_weight_int8pack_mm", "dynamic_quant", "zentorch_linear", "few_row_linear")
_ATTENTION = ("paged_attention", "write_kv", "scaled_dot_product", "cpu_attention", "cpu_attn",
              "reshape_and_cache", "index_select", "flash_attention", "_softmax", "attn")
_SMALL = ("rms_norm", "rotary", "silu", "embedding", "aten::add", "aten::mul", "aten::cat", "aten::copy_",
          "aten::to", "aten::_to_copy", "aten::view", "aten::slice", "aten::split", "aten::narrow", "aten::select",
          "aten::empty", "aten::index", "aten::contiguous", "aten::reshape", "aten::as_strided", "aten::t",
          "aten::transpose", "aten::unsqueeze", "aten::squeeze", "aten::fill_", "aten::zero", "layer_norm",
          "cpp_fused", "aten::clone", "aten::expand", "aten::sub", "aten::div", "aten::pow", "aten::rsqrt",
          "aten::mean", "aten::detach", "aten::lift", "aten::resize", "aten::set_")
_SAMPLING = ("argmax", "topk", "sort", "softmax", "exponential", "multinomial", "cumsum", "uniform", "gather",
             "scatter", "sampler", "top_k", "top_p")


def classify(name: str, under_logits: bool = False) -> str:
    """The class of one op's own time; a linear inside the lm_head's label is the logits."""
    low = name.lower()
    if any(k.lower() in low for k in _LINEAR):
        return "logits" if under_logits else "linears"
    if any(k.lower() in low for k in _ATTENTION):
        return "attention"
    if any(k.lower() in low for k in _SAMPLING):
        return "sampling"
    if any(k.lower() in low for k in _SMALL):
        return "small ops"
    return "other"
