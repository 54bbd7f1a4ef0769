"""Shared by the model tests: comparisons that print their difference, seeded generators,
randomised parameters, a tiny model, and the rotary formula in NumPy."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from llmcli.model.gpt import Transformer


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


def tiny_model(seed: int = 0, **kwargs) -> Transformer:
    args = {"vocab_size": 37, "n_layer": 2, "n_head": 4, "n_embed": 32, "context_length": 16}
    args.update(kwargs)
    return Transformer(**args, generator=gen(seed)).eval()


def numpy_rope(x: np.ndarray, positions: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """Rotate channel pairs (i, i + hs/2) of x (..., T, hs) by positions (T,) * base**(-2i/hs)."""
    hs = x.shape[-1]
    half = hs // 2
    theta = positions[:, None] * base ** (-2.0 * np.arange(half) / hs)  # (T, hs/2)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate(
        [a * np.cos(theta) - b * np.sin(theta), a * np.sin(theta) + b * np.cos(theta)], axis=-1
    )
