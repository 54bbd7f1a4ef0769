"""Head ablation (llmcli/inspection/ablation.py, at the `attn.z` hook point): against references.

References: a stack of `Head`s with one head's output replaced in the concatenation, a model
whose attention layers output `proj.bias` written out by hand, and the plain one-forward-per-head
Δloss (`head_deltas_full`) for the layer cache.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_helpers import assert_close, gen, randomize_, tiny_model

from llmcli.errors import InputError
from llmcli.evaluation.heads import (
    ablation_hooks,
    check_method,
    head_means,
    mask_heads,
    parse_ablate,
)
from llmcli.inspection.ablation import (
    HeadDeltas,
    format_top_heads,
    head_batch,
    head_deltas,
    head_deltas_full,
    top_heads,
)
from llmcli.model import MultiHeadAttention, hooked
from llmcli.model.heads import split_heads

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIONS = {
    "default": {},
    "rope+qknorm": {"pos_emb": "rope", "qk_norm": True},
}
SHAPE = {"n_head": 4, "n_embed": 32, "context_length": 8}


def sharp_model(seed: int = 0, **kwargs):
    """A tiny model with larger weights than the initialisation, so heads matter visibly."""
    model = tiny_model(seed, n_layer=3, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(6.0)
    return model


def random_batches(n: int = 3, B: int = 2, T: int = 16, vocab: int = 37, seed: int = 1):
    g = gen(seed)
    return [
        (torch.randint(vocab, (B, T), generator=g), torch.randint(vocab, (B, T), generator=g))
        for _ in range(n)
    ]


# ----------------------------------------------------------------------------- the model's hook


@pytest.mark.parametrize("explicit", [False, True], ids=["fused", "explicit"])
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_removing_a_head_equals_the_stack_of_heads_with_its_output_replaced(opts, explicit):
    mha = randomize_(MultiHeadAttention(**SHAPE, **opts)).eval()
    x = torch.randn(2, 8, 32, generator=gen(1))
    heads = split_heads(mha)
    outs = [h(x) for h in heads]  # 4 x (B, T, hs)
    mean = torch.randn(4, 8, generator=gen(2))  # (nh, hs)
    for h in range(4):
        mask = torch.ones(4)
        mask[h] = 0.0
        for head_mean in (None, mean):
            replaced = list(outs)
            fill = (
                torch.zeros_like(outs[h]) if head_mean is None else head_mean[h].expand_as(outs[h])
            )
            replaced[h] = fill
            ref = mha.proj(torch.cat(replaced, dim=-1))  # (B, T, C)
            fns = {"z": partial(mask_heads, keep=mask, mean=head_mean)}
            if explicit:  # reading the pattern makes the layer compute its weights explicitly
                fns["pattern"] = lambda w: None
            with hooked(mha, fns):
                y = mha(x)
            kind = "zero" if head_mean is None else "mean"
            assert_close(y, ref, f"head {h} {kind}, {'explicit' if explicit else 'fused'}")


def test_a_mask_per_batch_row_removes_each_rows_own_heads():
    mha = randomize_(MultiHeadAttention(**SHAPE)).eval()
    x = torch.randn(3, 8, 32, generator=gen(1))
    rows = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    with hooked(mha, {"z": partial(mask_heads, keep=rows)}):
        y = mha(x)  # (B, T, C)
    for b in range(3):
        with hooked(mha, {"z": partial(mask_heads, keep=rows[b])}):
            assert_close(y[b : b + 1], mha(x[b : b + 1]), f"row {b}")


def test_removing_every_head_leaves_proj_bias_computed_by_hand():
    model = randomize_(tiny_model(0, n_layer=3))
    idx = torch.randint(37, (2, 16), generator=gen(1))
    with model.hooks(ablation_hooks(torch.zeros(3, 4))):
        logits, _ = model(idx)
    with torch.no_grad():  # the model written out with each attention layer's output = proj.bias
        x = model.wte.weight[idx] + model.wpe.weight[:16]  # (B, T, C)
        for block in model.blocks:
            x = x + block.attn.proj.bias  # (B, T, C) + (C,)
            h = F.layer_norm(x, (32,), block.ln2.weight, block.ln2.bias)
            h = F.gelu(h @ block.mlp.fc.weight.T + block.mlp.fc.bias)  # (B, T, 4C)
            x = x + h @ block.mlp.proj.weight.T + block.mlp.proj.bias
        x = F.layer_norm(x, (32,), model.ln_f.weight, model.ln_f.bias)
        ref = x @ model.wte.weight.T  # tied LM head: (B, T, V)
    assert_close(logits, ref, "every head removed vs proj.bias by hand")


def test_a_mask_of_ones_changes_no_bit():
    model = sharp_model(0)
    idx = torch.randint(37, (2, 16), generator=gen(1))
    means = head_means(model, random_batches())
    plain, _ = model(idx)
    ones = torch.ones(3, 4)
    for mean in (None, means):  # at every layer (ablation_hooks would leave such layers alone)
        fns = {
            f"blocks.{i}.attn.z": partial(
                mask_heads, keep=ones[i], mean=None if mean is None else mean[i]
            )
            for i in range(3)
        }
        with model.hooks(fns):
            assert torch.equal(model(idx)[0], plain)


def test_head_means_are_the_mean_outputs_of_the_stack_of_heads():
    model = sharp_model(0)
    data = random_batches()
    means = head_means(model, data)  # (L, H, hs)
    outs = [[] for _ in model.blocks]
    hooks = [
        block.attn.register_forward_pre_hook(
            lambda m, args, i=i: outs[i].append(torch.stack([h(args[0]) for h in split_heads(m)]))
        )
        for i, block in enumerate(model.blocks)
    ]
    with torch.no_grad():
        for x, _ in data:
            model(x)
    for hook in hooks:
        hook.remove()
    for i in range(3):
        ref = torch.cat(outs[i], dim=1).mean(dim=(1, 2))  # (H, n*B, T, hs) -> (H, hs)
        assert_close(means[i], ref, f"mean head outputs, layer {i}")


# ----------------------------------------------------------------------------- Δloss per head


@pytest.mark.parametrize("per_pass", [None, 1, 3])
@pytest.mark.parametrize("opts", [{}, {"pos_emb": "rope", "norm": "rmsnorm"}], ids=["gpt2", "rope"])
def test_the_layer_cache_gives_the_deltas_of_full_recomputation(opts, per_pass):
    model = sharp_model(0, **opts)
    data = random_batches()
    fast = head_deltas(model, data, ("zero", "mean"), heads_per_pass=per_pass)
    full = head_deltas_full(model, data, ("zero", "mean"))
    assert fast.base_loss == pytest.approx(full.base_loss, rel=1e-6)
    assert (fast.batches, fast.tokens) == (3, 96)
    for method in ("zero", "mean"):
        assert np.abs(full.delta[method]).max() > 1e-2  # the heads matter here
        np.testing.assert_allclose(fast.delta[method], full.delta[method], atol=1e-5)


def test_a_method_named_twice_is_measured_once_and_a_pass_holds_a_head():
    model, data = sharp_model(0), random_batches()
    once = head_deltas(model, data, ("zero",))
    twice = head_deltas(model, data, ("zero", "zero"))
    np.testing.assert_array_equal(twice.delta["zero"], once.delta["zero"])
    with pytest.raises(InputError, match=r"heads_per_pass \(0\) must be at least 1"):
        head_deltas(model, data, heads_per_pass=0)


def test_a_head_that_writes_nothing_has_zero_delta():
    model = sharp_model(0)
    with torch.no_grad():
        model.blocks[1].attn.proj.weight[:, 8:16] = 0.0  # head 1 of layer 1 reaches nothing
    result = head_deltas(model, random_batches(), ("zero", "mean"))
    assert result.delta["zero"][1, 1] == pytest.approx(0.0, abs=1e-6)
    assert result.delta["mean"][1, 1] == pytest.approx(0.0, abs=1e-6)
    assert np.abs(result.delta["zero"]).max() > 1e-2


def test_the_deltas_are_token_weighted_over_batches_of_other_sizes():
    model = sharp_model(0)
    data = random_batches(2, B=2) + random_batches(1, B=3, T=9, seed=5)
    fast = head_deltas(model, data)
    full = head_deltas_full(model, data)
    assert fast.tokens == 2 * 32 + 27
    np.testing.assert_allclose(fast.delta["zero"], full.delta["zero"], atol=1e-5)


def test_head_batch_fits_the_budget():
    model = tiny_model(0)
    assert head_batch(model, 32) == 4  # tiny: every head of a layer at once
    per_copy = 32 * (8 * 32 + 3 * 37) * 4
    assert head_batch(model, 32, budget=2 * per_copy) == 2
    assert head_batch(model, 32, budget=1) == 1


def test_top_heads_and_their_summary():
    delta = np.array([[0.1, 0.5, -0.2], [0.05, 0.0, 0.3]])
    assert top_heads(delta, 3) == [(0, 1, 0.5), (1, 2, 0.3), (0, 0, 0.1)]
    result = HeadDeltas(base_loss=2.5, delta={"zero": delta, "mean": -delta}, batches=3, tokens=96)
    assert format_top_heads(result, k=2).splitlines() == [
        "head ablation on 3 validation batches (96 tokens): clean loss 2.5000 nats/token",
        "top heads by dloss_zero (layer.head, nats/token; median +0.0750): 0.1 +0.5000, "
        "1.2 +0.3000",
        "top heads by dloss_mean (layer.head, nats/token; median -0.0750): 0.2 +0.2000, "
        "1.1 +0.0000",  # -0.0 rounds to no sign
    ]
    near_zero = HeadDeltas(2.5, {"zero": np.array([[-4e-5, -3e-5]])}, batches=1, tokens=8)
    assert "median +0.0000): 0.1 +0.0000, 0.0 +0.0000" in format_top_heads(near_zero)


# ----------------------------------------------------------------------------- options


def test_parse_ablate_heads_and_layers():
    mask = parse_ablate(["0.1", "2", " 1.3 "], 3, 4)
    expected = torch.ones(3, 4)
    expected[0, 1] = expected[2] = expected[1, 3] = 0.0
    assert torch.equal(mask, expected)
    assert torch.equal(parse_ablate([], 3, 4), torch.ones(3, 4))
    assert torch.equal(parse_ablate(["1"], 3, 4), parse_ablate(["1.0", "1.1", "1.2", "1.3"], 3, 4))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("9.9", r"layer 9 is past the last layer \(2\).*L from 0 to 2 and H from 0 to 3"),
        ("1.4", r"head 4 is past the last head \(3\).*L from 0 to 2 and H from 0 to 3"),
        ("3", r"layer 3 is past the last layer"),
        ("x", r"'x' is not a head or a layer: write L.H .* or L "),
        ("1.", r"'1.' is not a head or a layer"),
        ("-1", r"'-1' is not a head or a layer.*L from 0 to 2"),
        ("1.2.3", r"not a head or a layer"),
        ("", r"not a head or a layer"),
        ("1" * 5000, r"not a head or a layer"),  # not int()'s ValueError past 4,300 digits
        ("\u0663", r"not a head or a layer"),  # a digit, but not an ASCII one
    ],
)
def test_parse_ablate_names_the_forms_and_ranges(spec, message):
    with pytest.raises(InputError, match=message):
        parse_ablate([spec], 3, 4)


def test_check_method():
    assert check_method("mean") == "mean"
    with pytest.raises(InputError, match=r"--ablation 'foo' is not known: choose zero or mean"):
        check_method("foo")
    with pytest.raises(InputError, match=r"zero or mean or both"):
        check_method("all", ("zero", "mean", "both"))


def test_the_passes_report_progress_each_tenth_once(monkeypatch, caplog) -> None:
    import io
    import logging
    import sys

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: plain lines
    model, data = sharp_model(0), random_batches(n=13)
    with caplog.at_level(logging.INFO, logger="llmcli.progress"):
        quiet = head_deltas(model, data, ("zero", "mean"))
        shown = head_deltas(model, data, ("zero", "mean"), progress=True)
    np.testing.assert_array_equal(shown.delta["mean"], quiet.delta["mean"])
    lines = [r.getMessage().split(",")[0] for r in caplog.records if r.name == "llmcli.progress"]
    tenths = sorted({-(-k * 13 // 10) for k in range(1, 11)})  # ceil(k * 13 / 10)
    assert lines == [f"head means {n}/13" for n in tenths] + [f"ablation {n}/13" for n in tenths]
