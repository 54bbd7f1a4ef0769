"""Building blocks that the model's recipe options add: RMSNorm, QK-norm, rotary embeddings.

All are off by default; `llmcli.model.gpt` uses them for `norm: rmsnorm`, `qk_norm: true` and
`pos_emb: rope`. The choices were checked by `ModelConfig` (an even head size for rope, one of
the norms), so the layers do not check them again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmcli.errors import InputError

if TYPE_CHECKING:
    from llmcli.config import ModelConfig

Rotation = tuple[Tensor, Tensor]  # (cos, sin) of RotaryEmbedding.angles


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019): `x / sqrt(mean(x**2) + eps) * weight`.

    Unlike LayerNorm it neither subtracts the mean nor adds a bias.

    Args:
        n_embed: size of the last dimension `C`.
        eps: added to the mean square for stability.

    Shape:
        (..., C) -> (..., C)
    """

    def __init__(self, n_embed: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_embed))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def qk_rms_norm(x: Tensor) -> Tensor:
    """QK-norm: parameter-free RMSNorm over the head dimension (as in nanochat, modded-nanogpt).

    Applied to queries and keys before the dot product, it bounds the attention logits, which
    lets training use larger learning rates without logit blow-up.

    Shape:
        (..., hs) -> (..., hs), each vector with root-mean-square 1.
    """
    return F.rms_norm(x, (x.shape[-1],), eps=1e-5)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021), "rotate half" layout as in GPT-NeoX/Llama.

    Channel `i` and channel `i + hs/2` form a pair rotated by the angle `pos * base**(-2i/hs)`:
    `(a, b) -> (a cos - b sin, a sin + b cos)`. A rotation keeps norms, and
    `rot(q, m) . rot(k, n)` depends only on `m - n`, so attention sees relative positions.

    Built from a model config: head size `hs = n_embed // n_head` (must be even), positions
    `0 .. context_length - 1` precomputed, frequency base `rope_base` (10000 in the paper).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        head_size, base = config.n_embed // config.n_head, config.rope_base
        context_length = config.context_length
        exponent = torch.arange(0, head_size, 2, dtype=torch.float64) / head_size  # (hs/2,)
        inv_freq = base**-exponent  # (hs/2,)
        positions = torch.arange(context_length, dtype=torch.float64)  # (L,)
        angles = torch.outer(positions, inv_freq)  # (L, hs/2)
        cos, sin = angles.cos(), angles.sin()
        # Both halves of a pair share an angle; the minus sign of `rotate_half` is folded into sin.
        cos = torch.cat([cos, cos], dim=-1).float()  # (L, hs)
        sin = torch.cat([-sin, sin], dim=-1).float()  # (L, hs)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def angles(self, T: int, input_pos: Tensor | None = None, offset: int = 0) -> Rotation:
        """The rotation of `T` positions: `input_pos` `(T,)` or `(B, T)`, else
        `offset .. offset + T - 1`.

        Returns:
            `(cos, sin)`, each `(T, hs)`, or `(B, T, hs)` for `(B, T)` positions.
        """
        if input_pos is None:
            if offset + T > len(self.cos):
                raise InputError(
                    f"rotary positions {offset}..{offset + T - 1} are past the model's "
                    f"context_length ({len(self.cos)}): give at most {len(self.cos) - offset} "
                    "positions"
                )
            return self.cos[offset : offset + T], self.sin[offset : offset + T]  # (T, hs) each
        return self.cos[input_pos], self.sin[input_pos]  # (T, hs) or (B, T, hs) each

    def forward(self, x: Tensor, input_pos: Tensor | None = None, offset: int = 0) -> Tensor:
        """Rotate `x` `(..., T, hs)` (time on dim -2) by its positions; see `angles`."""
        return rotate(x, self.angles(x.shape[-2], input_pos, offset))


def rotate(x: Tensor, rotation: Rotation) -> Tensor:
    """Apply a rotation from `RotaryEmbedding.angles` to `x`: `(a, b) -> (a cos - b sin, a sin +
    b cos)` for each channel pair (i, i + hs/2).

    Shape:
        x `(B, T, hs)` or `(B, nh, T, hs)` (time on dim -2), cos and sin `(T, hs)` or
        `(B, T, hs)` -> the shape of `x`.
    """
    cos, sin = rotation
    if x.ndim == 4 and cos.ndim == 3:  # per-row positions, heads between batch and time
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, hs)
    rotated_half = x.roll(x.shape[-1] // 2, dims=-1)  # (..., hs): [b, a] for x = [a, b]
    return torch.addcmul(x * cos.to(x.dtype), rotated_half, sin.to(x.dtype))


def make_norm(config: ModelConfig) -> nn.Module:
    """The normalisation layer `config.norm` names ("layernorm" or "rmsnorm") over `n_embed`
    channels; `config.bias` applies to LayerNorm only (RMSNorm has none)."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embed)
    return nn.LayerNorm(config.n_embed, bias=config.bias)
