"""Building blocks that the model's recipe options add: RMSNorm, QK-norm, rotary embeddings;
and head ablation (`mask_heads`).

All are off by default; `llmcli.model.gpt` uses them for `norm: rmsnorm`, `qk_norm: true` and
`pos_emb: rope`, and `mask_heads` for its `head_mask` argument (`llmcli.inspection.ablation`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmcli.errors import InputError

NORMS = ("layernorm", "rmsnorm")


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


def mask_heads(y: Tensor, head_mask: Tensor, head_mean: Tensor | None = None) -> Tensor:
    """Head ablation: keep (1) or remove (0) each head's output, before the output projection.

    A removed head outputs zeros, or its `head_mean` (mean ablation). With a mask of ones the
    values of `y` come back unchanged, bit for bit (`y * 1`, `+ 0 * mean`).

    Shape:
        y `(B, nh, T, hs)`; head_mask `(nh,)` or, one mask per batch row, `(B, nh)`;
        head_mean `(nh, hs)` -> `(B, nh, T, hs)`.
    """
    m = head_mask.to(y.dtype)[..., None, None]  # (nh, 1, 1) or (B, nh, 1, 1)
    y = y * m  # (B, nh, T, hs)
    if head_mean is not None:
        mean = head_mean.to(y.dtype)[:, None, :]  # (nh, 1, hs)
        y = y + (1 - m) * mean  # (B, nh, T, hs)
    return y


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021), "rotate half" layout as in GPT-NeoX/Llama.

    Channel `i` and channel `i + hs/2` form a pair rotated by the angle `pos * base**(-2i/hs)`:
    `(a, b) -> (a cos - b sin, a sin + b cos)`. A rotation keeps norms, and
    `rot(q, m) . rot(k, n)` depends only on `m - n`, so attention sees relative positions.

    Args:
        head_size: `hs`, must be even.
        context_length: number of positions precomputed (positions must be < this).
        base: the frequency base (10000 in the paper).
    """

    def __init__(self, head_size: int, context_length: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_size % 2 != 0:
            raise InputError(f"rotary embeddings need an even head size, got {head_size}")
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

    def forward(self, x: Tensor, position_ids: Tensor | None = None, offset: int = 0) -> Tensor:
        """Rotate `x` by its positions.

        Args:
            x: `(B, T, hs)` or `(B, T, nh, hs)`: time on dim 1, channels last.
            position_ids: `(B, T)` long, or None for positions `offset .. offset + T - 1`.
            offset: first position when `position_ids` is None.

        Returns:
            Tensor of the same shape as `x`.
        """
        T, hs = x.shape[1], x.shape[-1]
        if position_ids is None:
            cos = self.cos[offset : offset + T]  # (T, hs)
            sin = self.sin[offset : offset + T]  # (T, hs)
        else:
            cos = self.cos[position_ids]  # (B, T, hs)
            sin = self.sin[position_ids]  # (B, T, hs)
        if x.ndim == 4:  # heads sit between time and channels
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (T, 1, hs) or (B, T, 1, hs)
        rotated_half = x.roll(hs // 2, dims=-1)  # (B, T, ..., hs): [b, a] for x = [a, b]
        return torch.addcmul(x * cos.to(x.dtype), rotated_half, sin.to(x.dtype))


def make_norm(norm: str, n_embed: int, bias: bool) -> nn.Module:
    """The normalisation layer `norm` names ("layernorm" or "rmsnorm") over `n_embed` channels.

    `bias` applies to LayerNorm only; RMSNorm has none.
    """
    if norm == "layernorm":
        return nn.LayerNorm(n_embed, bias=bias)
    if norm == "rmsnorm":
        return RMSNorm(n_embed)
    raise InputError(f"norm must be one of {NORMS}, got {norm!r}")
