"""Rotary position embedding, RoPE (Su et al. 2021, "RoFormer"; chapter 01), in Hugging Face's rotate-half
convention, with Llama 3.1's frequency scaling.

Head dimension ``d``, pair ``i`` of ``d/2``: frequency ``w_i = theta^(-2i/d)``; a query or key at position
``p`` has its dims ``i`` and ``i + d/2`` rotated by the angle ``p w_i``:

    rope(x)_p = x_p cos(p w) + rotate_half(x_p) sin(p w),   rotate_half([x1, x2]) = [-x2, x1].

The score of a query at ``p`` and a key at ``q`` then depends on ``p - q`` only, so attention sees relative
positions and the model has no position table. (The original pairs interleaved dims ``2i, 2i+1``; Hugging
Face's Llama pairs ``i, i + d/2``: the same rotation of permuted dims, and the one a converted checkpoint's
q/k weights expect.)

``rope_type="llama3"`` (Llama 3.1; Hugging Face's ``_compute_llama3_parameters``): with ``L`` the original
context, wavelengths ``2 pi / w`` longer than ``L / low_freq_factor`` are divided by ``factor``, shorter than
``L / high_freq_factor`` kept, and those between interpolated, ``s = (L / wavelen - low) / (high - low)``,
``w' = (1 - s) w / factor + s w``.

The angles are computed in float64 and cos/sin cast to the activations' dtype: a float64 model is float64
throughout (float32 angles at position 4096 are off by about ``4096 x 6e-8``). Context parallelism
(chapter 07) replaces ``position_ids`` on the instance by the global positions of the rank's chunks.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from refimpl.config import ModelConfig

__all__ = ["RotaryEmbedding", "apply_rotary", "rope_frequencies", "rotate_half"]


def rope_frequencies(config: ModelConfig, device: torch.device | str | None = None, *,
                     dim: int | None = None) -> torch.Tensor:
    """``w_i`` of the module docstring, ``[d/2]`` float64 on ``device`` (the llama3 scaling applied when
    asked); ``d`` is ``dim``, else ``config.head_dim`` (multi-head latent attention rotates only its
    ``qk_rope_head_dim`` dims, ``refimpl.models.mla``)."""
    d = dim or config.head_dim
    w = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)  # [d/2]
    if config.rope_type == "default":
        return w
    low, high, factor = config.rope_low_freq_factor, config.rope_high_freq_factor, config.rope_factor
    context = config.rope_original_max_position
    wavelen = 2 * math.pi / w
    scaled = torch.where(wavelen > context / low, w / factor, w)
    s = (context / wavelen - low) / (high - low)
    medium = (wavelen <= context / low) & (wavelen >= context / high)
    return torch.where(medium, (1 - s) * scaled / factor + s * scaled, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (its two halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [b, heads, s, d]`` rotated by the angles whose ``cos``, ``sin`` are ``[s, d]``."""
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """cos and sin of the rotation angles of ``seq_len`` positions, ``[s, d]`` each (no parameters);
    ``d`` is ``dim``, else ``config.head_dim``."""

    def __init__(self, config: ModelConfig, *, dim: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.dim = dim or config.head_dim

    @staticmethod
    def position_ids(seq_len: int, device: torch.device) -> torch.Tensor:
        """The positions of ``seq_len`` tokens, ``[0, seq_len)``; context parallelism replaces it."""
        return torch.arange(seq_len, device=device)  # [s]

    def forward(self, seq_len: int, *, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = self.position_ids(seq_len, device).to(torch.float64)  # [s]
        angles = positions[:, None] * rope_frequencies(self.config, device, dim=self.dim)  # [s, d/2]
        angles = torch.cat((angles, angles), dim=-1)  # [s, d]: pair i and i + d/2 share an angle
        return angles.cos().to(dtype), angles.sin().to(dtype)
