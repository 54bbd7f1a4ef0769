"""Tests of the recipe-option layers against their formulas: rotary embeddings, RMSNorm."""

from __future__ import annotations

import numpy as np
import torch
from model_helpers import assert_close, gen, numpy_rope, randomize_, tiny_model
from torch import nn

from llmcli.config import ModelConfig
from llmcli.model.layers import RMSNorm, RotaryEmbedding


def test_rope_rotation_matches_formula_keeps_norms_and_is_relative():
    rot = RotaryEmbedding(ModelConfig(n_head=1, n_embed=16, context_length=32, rope_base=10000.0))
    x = torch.randn(3, 32, 16, generator=gen(1))  # (B, T, hs)
    y = rot(x)
    assert_close(y, numpy_rope(x.double().numpy(), np.arange(32.0)), "rope vs numpy formula")
    assert_close(y.norm(dim=-1), x.norm(dim=-1), "rope keeps norms")
    assert_close(y[:, 0], x[:, 0], "rope at position 0 is identity", atol=0, rtol=0)
    # q . k depends only on the offset m - n: shift both positions by s.
    q, k = torch.randn(1, 1, 16, generator=gen(2)), torch.randn(1, 1, 16, generator=gen(3))
    dots = []
    for s in (0, 5, 17):
        qm = rot(q, torch.tensor([[7 + s]]))
        kn = rot(k, torch.tensor([[3 + s]]))
        dots.append((qm * kn).sum())
    assert_close(torch.stack(dots), dots[0].expand(3), "rope q.k shift invariance")
    assert not torch.allclose(
        (rot(q, torch.tensor([[7]])) * rot(k, torch.tensor([[3]]))).sum(),
        (rot(q, torch.tensor([[7]])) * rot(k, torch.tensor([[4]]))).sum(),
    )
    # input_pos and offset give the same rotation as the default positions.
    assert_close(rot(x[:, 4:9], offset=4), y[:, 4:9], "rope offset", atol=0, rtol=0)
    pos = torch.arange(4, 9).expand(3, -1)
    assert_close(rot(x[:, 4:9], pos), y[:, 4:9], "rope input_pos", atol=0, rtol=0)


def test_rope_on_heads_rotates_each_head_by_its_rows_positions():
    """`(B, nh, T, hs)`, the layout attention rotates: time on dim -2, each row with its own
    positions, every head of a row alike."""
    rot = RotaryEmbedding(ModelConfig(n_head=1, n_embed=8, context_length=16, rope_base=100.0))
    x = torch.randn(2, 3, 5, 8, generator=gen(4))  # (B, nh, T, hs)
    pos = torch.tensor([[0, 1, 2, 3, 4], [9, 10, 11, 12, 13]])  # (B, T)
    y = rot(x, pos)
    for b in range(2):
        for h in range(3):
            ref = numpy_rope(x[b, h].double().numpy()[None], pos[b].double().numpy(), 100.0)[0]
            assert_close(y[b, h], ref, f"rope row {b} head {h} vs numpy formula")
    assert_close(rot(x, offset=9)[1], y[1], "offset = the row's positions", atol=0, rtol=0)


def test_rmsnorm_matches_formula():
    norm = randomize_(RMSNorm(32))
    x = torch.randn(2, 5, 32, generator=gen(1)) * 3 + 1
    ref = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert_close(norm(x), ref, "rmsnorm vs formula")
    model = tiny_model(norm="rmsnorm")
    norms = [model.ln_f] + [m for b in model.blocks for m in (b.ln1, b.ln2)]
    assert all(isinstance(m, RMSNorm) for m in norms)
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())
