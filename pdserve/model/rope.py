"""Rotary position embeddings: a cos/sin table indexed by position, applied in place of HF's."""

from __future__ import annotations

import math

import torch

from pdserve.config.model import RopeConfig


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
    """Precomputed cos/sin for positions [0, max_positions).

    Per step, `lookup` gathers the rows for the batch's positions once; every layer then calls
    `apply` on its q and k heads together.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device) -> None:
        inv_freq = inverse_frequencies(rope, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.interleaved = rope.interleaved
        if self.interleaved:  # GPT-J pairs (x0, x1), (x2, x3), ...
            cos = freqs.cos().repeat_interleave(2, dim=-1)
            sin = torch.stack((-freqs.sin(), freqs.sin()), dim=-1).flatten(-2)
        else:  # rotate_half: halves (x[:d/2], x[d/2:])
            cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)
            sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        # The sign of rotate_half is folded into `sin`, so applying is two multiplies and one swap.
        self.cos = cos.to(device)
        self.sin = sin.to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [tokens, heads, head_dim] -> rotated copy (fp32 math, x's dtype out)."""
        cos, sin = cos_sin
        xf = x.float()
        if self.interleaved:
            swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        else:
            half = xf.shape[-1] // 2
            swapped = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos + swapped * sin).to(x.dtype)
