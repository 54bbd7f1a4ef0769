"""AdamW parameter groups and the learning-rate schedules (llmcli/training/optim.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llmcli.config import ModelConfig, TrainConfig
from llmcli.model.gpt import Transformer
from llmcli.training.optim import apply_lr, build_optimizer, learning_rate, lr_at, param_groups


def tiny_model(**overrides) -> Transformer:
    cfg = ModelConfig(n_layer=2, n_head=2, n_embed=16, context_length=8, **overrides)
    return Transformer(cfg, 11, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tie", [True, False])
def test_groups_split_matrices_from_vectors_and_list_each_parameter_once(tie: bool) -> None:
    model = tiny_model(tie_embeddings=tie)
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    named = dict(model.named_parameters())
    assert all(named[n].dim() >= 2 for n in decay["names"])
    assert all(named[n].dim() < 2 for n in no_decay["names"])
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert "wte.weight" in decay["names"]
    assert ("lm_head.weight" in decay["names"]) is (not tie)
    assert any(n.endswith(".bias") for n in no_decay["names"])
    assert "ln_f.weight" in no_decay["names"]


def test_adamw_decays_only_the_decay_group() -> None:
    # With zero gradients Adam's update is 0, so only decoupled weight decay moves a parameter:
    # p <- p * (1 - lr * wd) in the decay group, unchanged in the other.
    model = tiny_model()
    train = TrainConfig(lr=0.01, weight_decay=0.5, max_steps=10, warmup_steps=0)
    opt = build_optimizer(model, train, "cpu")
    assert opt.defaults["fused"] is True
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    decay_names, no_decay_names = opt.param_groups[0]["names"], opt.param_groups[1]["names"]
    for name, p in model.named_parameters():
        if name in decay_names:
            torch.testing.assert_close(p.detach(), before[name] * (1 - 0.01 * 0.5))
        else:
            assert name in no_decay_names
            assert torch.equal(p.detach(), before[name])


def test_unknown_optimizer_is_a_config_error() -> None:
    train = TrainConfig()
    object.__setattr__(train, "optimizer", "sgd")
    with pytest.raises(ValueError, match="train.optimizer"):
        build_optimizer(tiny_model(), train, "cpu")


def reference_cosine(s: np.ndarray, lr: float, min_lr: float, w: int, n: int) -> np.ndarray:
    warm = lr * (s + 1) / (w + 1)
    p = np.clip((s - w) / (n - 1 - w), 0, 1)
    cos = min_lr + (lr - min_lr) * 0.5 * (1 + np.cos(np.pi * p))
    return np.where(s < w, warm, cos)


@pytest.mark.parametrize("w", [0, 1, 10])
def test_cosine_matches_the_formula_starts_above_zero_and_ends_at_min_lr(w: int) -> None:
    n, lr, min_lr = 100, 1e-3, 1e-4
    steps = np.arange(n)
    got = np.array(
        [learning_rate(int(s), lr=lr, min_lr=min_lr, warmup_steps=w, max_steps=n) for s in steps]
    )
    np.testing.assert_allclose(got, reference_cosine(steps, lr, min_lr, w, n), rtol=1e-12)
    assert got[0] > 0
    assert got[w] == pytest.approx(lr)
    assert got[-1] == pytest.approx(min_lr)
    assert np.all(np.diff(got[: w + 1]) > 0)  # warmup rises
    assert np.all(np.diff(got[w:]) <= 0)  # then decays


def test_wsd_warms_up_holds_then_decays_linearly_to_min_lr() -> None:
    n, w, lr, min_lr, frac = 100, 10, 1e-3, 0.0, 0.2
    got = np.array(
        [
            learning_rate(
                s,
                lr=lr,
                min_lr=min_lr,
                warmup_steps=w,
                max_steps=n,
                schedule="wsd",
                decay_fraction=frac,
            )
            for s in range(n)
        ]
    )
    np.testing.assert_allclose(got[:w], lr * np.arange(1, w + 1) / (w + 1))
    np.testing.assert_allclose(got[w:80], lr)  # stable until the last 20% of the steps
    np.testing.assert_allclose(got[80:], lr + (min_lr - lr) * np.arange(20) / 19, atol=1e-15)
    assert got[-1] == min_lr


def test_cosine_with_a_warmup_up_to_the_last_step_ends_at_min_lr() -> None:
    """W = N - 1: the peak's step and the last are next to each other; the decay is a single
    step from lr to min_lr (a span of 0, not a division by it)."""
    got = [learning_rate(s, lr=1.0, min_lr=0.25, warmup_steps=4, max_steps=5) for s in range(5)]
    assert got == [0.2, 0.4, 0.6, 0.8, 0.25]


@pytest.mark.parametrize(
    ("w", "n", "frac", "expected"),
    [
        # 0.04 x 10 rounds to 0 decay steps: the last step still decays, alone.
        (0, 10, 0.04, [1.0] * 9 + [0.0]),
        # The last 5 of 10 steps would begin inside the 7-step warmup: the decay starts at the
        # peak, step 7, and reaches min_lr at step 9.
        (7, 10, 0.5, [1 / 8, 2 / 8, 3 / 8, 4 / 8, 5 / 8, 6 / 8, 7 / 8, 1.0, 0.5, 0.0]),
    ],
)
def test_wsd_decays_over_at_least_the_last_step_and_after_the_warmup(w, n, frac, expected) -> None:
    got = [
        learning_rate(
            s, lr=1.0, min_lr=0.0, warmup_steps=w, max_steps=n, schedule="wsd", decay_fraction=frac
        )
        for s in range(n)
    ]
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_apply_lr_scales_every_group_from_its_own_peak() -> None:
    model = tiny_model()
    train = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=5, max_steps=50)
    opt = build_optimizer(model, train, "cpu")
    opt.param_groups[1]["base_lr"] = 0.02  # a group with another peak (as a Muon group has)
    for step in (0, 3, 5, 20, 49):
        lr = apply_lr(opt, step, train)
        assert lr == lr_at(step, train)
        assert opt.param_groups[0]["lr"] == pytest.approx(lr)
        assert opt.param_groups[1]["lr"] == pytest.approx(0.02 * lr / 1e-3)
    assert math.isclose(opt.param_groups[0]["lr"], 1e-4)
