"""Shared by the model tests: comparisons that print their difference, seeded generators,
randomised parameters, a tiny model, the rotary formula in NumPy, left-padded batches, and an
attention layer run with its weights read."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from llmcli.config import ModelConfig
from llmcli.model import Transformer, hooked

# Every recipe option at once, against the default model: what a test of the maths runs on.
RECIPE_OPTIONS = {
    "default": {},
    "all-options": {
        "pos_emb": "rope",
        "norm": "rmsnorm",
        "qk_norm": True,
        "mlp": "relu2",
        "tie_embeddings": False,
        "bias": False,
    },
}


def assert_close(actual, expected, name: str, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """`torch.testing.assert_close`, printing the max abs difference first."""
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    diff = (actual.detach() - expected).abs().max().item() if actual.numel() else 0.0
    print(f"max_abs_diff {name}: {diff:.3e}")
    torch.testing.assert_close(actual.detach(), expected, atol=atol, rtol=rtol)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Give every parameter (biases and norm gains included) random non-trivial values."""
    g = gen(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def tiny_model(seed: int = 0, vocab_size: int = 37, **kwargs) -> Transformer:
    """A 2-layer model in eval mode; keyword arguments are `ModelConfig` values."""
    config = ModelConfig(
        **{"n_layer": 2, "n_head": 4, "n_embed": 32, "context_length": 16, **kwargs}
    )
    return Transformer(config, vocab_size, generator=gen(seed)).eval()


def numpy_rope(x: np.ndarray, positions: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """Rotate channel pairs (i, i + hs/2) of x (..., T, hs) by positions (T,) * base**(-2i/hs)."""
    hs = x.shape[-1]
    half = hs // 2
    theta = positions[:, None] * base ** (-2.0 * np.arange(half) / hs)  # (T, hs/2)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate(
        [a * np.cos(theta) - b * np.sin(theta), a * np.sin(theta) + b * np.cos(theta)], axis=-1
    )


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of different lengths as one left-padded batch: `(idx (B, T), pads (B,))`,
    padding columns holding token 0 and every row ending at column `T - 1`."""
    T = max(len(r) for r in rows)
    idx = torch.zeros(len(rows), T, dtype=torch.long)
    for b, row in enumerate(rows):
        idx[b, T - len(row) :] = row
    return idx, torch.tensor([T - len(r) for r in rows])


def with_weights(mha: nn.Module, x: torch.Tensor, mask=None, input_pos=None, kv_cache=None):
    """`mha(x, mask, input_pos, kv_cache)` and its attention weights `(B, nh, T, T_k)`, read at
    its `pattern` hook (which makes it compute them explicitly)."""
    weights = []
    with hooked(mha, {"pattern": weights.append}):
        y = mha(x, mask, input_pos, kv_cache)
    return y, weights[0]
