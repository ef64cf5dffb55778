"""Rotary position embedding, with the frequency scalings the supported families use.

Two pairings: rotate-half (x_i with x_{i + D/2}: Llama, Qwen, Gemma) and interleaved
(x_{2i} with x_{2i+1}: Llama 4, DeepSeek-V3's decoupled RoPE part). Scalings: Llama 3's
per-frequency smoothing, linear (Gemma 3's global layers) and YaRN (DeepSeek-V3, Kimi
K2), whose attention factor multiplies cos and sin. cos/sin are computed for
each step's positions, once per step for all layers.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from infire.config import RopeScaling
from infire.kernels.triton_support import use_triton


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """RoPE inverse frequencies, scaled as `scaling` says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_frequencies(head_dim, theta, scaling)
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: RopeScaling | None) -> float:
    """What a scaling multiplies cos and sin by (1 but for YaRN)."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return yarn_mscale(scaling.factor)


def _yarn_frequencies(dim: int, base: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: extrapolated high frequencies, interpolated low ones, a linear ramp between."""
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin of a step's positions, computed from the inverse frequencies (no table
    over the whole context: Llama 4 Scout's 10M positions would take gigabytes)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.interleaved = interleaved
        self.max_positions = max_positions
        # a plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)
        self.factor = attention_factor(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[2, T, 1, D] cos and sin of this step's positions, computed once per step."""
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32).unsqueeze(1) * inv_freq
        emb = freqs.repeat_interleave(2, -1) if self.interleaved else torch.cat((freqs, freqs), -1)
        cos_sin = torch.stack((emb.cos(), emb.sin()))
        if self.factor != 1.0:
            cos_sin = cos_sin * self.factor
        return cos_sin.to(dtype).unsqueeze(2)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin [max_positions, D] of every position (the fused forward's)."""
        positions = torch.arange(self.max_positions, device=self.inv_freq.device)
        cos_sin = self.cos_sin(positions, torch.float32)
        return cos_sin[0, :, 0], cos_sin[1, :, 0]


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [T, heads, D] (q and k heads together) with cos/sin from cos_sin()."""
    if use_triton(x):  # one launch
        from infire.kernels.triton_ops import rotary

        return rotary(x, cos_sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos_sin[0] + rotated * cos_sin[1]


def apply_rotary_interleaved(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (x_{2i}, x_{2i+1}) of x [T, heads, D]."""
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * cos_sin[0] + rotated * cos_sin[1]
