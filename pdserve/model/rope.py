"""Rotary position embeddings: a cos/sin table indexed by position, applied in place of HF's."""

from __future__ import annotations

import math

import torch

from pdserve.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / rope.factor,
                               torch.where(wavelen < high_wavelen, inv_freq, smoothed))
    return inv_freq.float()


class RotaryEmbedding:
    """Precomputed cos/sin for positions [0, max_positions); `apply` rotates q and k in one call."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device) -> None:
        inv_freq = inverse_frequencies(rope, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.interleaved = rope.interleaved
        if self.interleaved:
            freqs = freqs.repeat_interleave(2, dim=-1)
        else:
            freqs = torch.cat((freqs, freqs), dim=-1)
        self.cos = freqs.cos().to(device)
        self.sin = freqs.sin().to(device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim] -> rotated copy (fp32 math, input dtype out)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        xf = x.float()
        if self.interleaved:
            rotated = torch.stack((-xf[..., 1::2], xf[..., 0::2]), dim=-1).flatten(-2)
        else:
            half = xf.shape[-1] // 2
            rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)
