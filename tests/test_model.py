"""Tests that pin the model's maths against references.

References: a NumPy float64 implementation of the per-head formula, a stack of `Head`s,
`torch.nn.MultiheadAttention`, and Hugging Face `GPT2LMHeadModel`. Everything runs in fp32 at tiny
sizes. Each comparison prints its max abs difference (`pytest -s` shows them).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from model_helpers import (
    assert_close,
    context,
    gen,
    numpy_rope,
    randomize_,
    tiny_model,
    with_weights,
)
from torch import nn

from llmcli.config import ModelConfig
from llmcli.errors import InputError
from llmcli.model import MLP, Block, Head, MultiHeadAttention, Transformer
from llmcli.model.layers import RMSNorm

OPTIONS = {
    "default": {},
    "rope+qknorm": {"pos_emb": "rope", "qk_norm": True},
}
SHAPE = {"n_head": 4, "n_embed": 32, "context_length": 8}  # the seed's example layer


# ----------------------------------------------------------------------------- NumPy reference


def numpy_mha(x, mha: MultiHeadAttention, pos_emb="learned", qk_norm=False):
    """The per-head formula in float64: softmax(QK^T/sqrt(hs)) causal, @V, cat, proj."""
    x = x.detach().double().numpy()
    W = mha.qkv.weight.detach().double().numpy()
    b = mha.qkv.bias.detach().double().numpy()
    Wp = mha.proj.weight.detach().double().numpy()
    bp = mha.proj.bias.detach().double().numpy()
    B, T, C = x.shape
    nh = mha.n_head
    hs = C // nh
    qkv = x @ W.T + b  # (B, T, 3C)
    mask = np.tril(np.ones((T, T), dtype=bool))
    outs, weights = [], []
    for h in range(nh):
        q = qkv[..., h * hs : (h + 1) * hs]
        k = qkv[..., C + h * hs : C + (h + 1) * hs]
        v = qkv[..., 2 * C + h * hs : 2 * C + (h + 1) * hs]
        if qk_norm:
            q = q / np.sqrt((q**2).mean(-1, keepdims=True) + 1e-5)
            k = k / np.sqrt((k**2).mean(-1, keepdims=True) + 1e-5)
        if pos_emb == "rope":
            q, k = numpy_rope(q, np.arange(T)), numpy_rope(k, np.arange(T))
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hs)
        s = np.where(mask, s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        w = e / e.sum(-1, keepdims=True)
        weights.append(w)
        outs.append(w @ v)
    y = np.concatenate(outs, axis=-1) @ Wp.T + bp
    return torch.from_numpy(y).float(), torch.from_numpy(np.stack(weights, 1)).float()


# ----------------------------------------------------------------------------- attention


def test_usage_examples_run_as_written():
    assert MultiHeadAttention(n_head=4, n_embed=32, context_length=8)(
        torch.randn(2, 8, 32)
    ).shape == (2, 8, 32)
    assert Block(n_head=4, n_embed=32, context_length=8)(torch.randn(2, 8, 32)).shape == (2, 8, 32)


@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_mha_equals_numpy_per_head_formula(opts):
    mha = randomize_(MultiHeadAttention(**SHAPE, **opts)).eval()
    x = torch.randn(2, 8, 32, generator=gen(1))
    y_ref, w_ref = numpy_mha(x, mha, **opts)
    tag = "+".join(opts) or "default"
    assert_close(mha(x), y_ref, f"mha fused vs numpy [{tag}]")
    y, w = with_weights(mha, x)
    assert_close(y, y_ref, f"mha explicit vs numpy [{tag}]")
    assert_close(w, w_ref, f"mha weights vs numpy [{tag}]")


@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_from_heads_equals_stack_of_heads(opts):
    torch.manual_seed(0)
    heads = [Head(**SHAPE, bias=False, **opts) for _ in range(4)]  # proj's bias alone
    proj = nn.Linear(32, 32)
    x = torch.randn(2, 8, 32, generator=gen(1))
    ref = proj(torch.cat([h(x) for h in heads], dim=-1))
    mha = MultiHeadAttention.from_heads(heads, proj)
    tag = "+".join(opts) or "default"
    assert_close(mha(x), ref, f"from_heads vs stack of Heads [{tag}]")


@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_heads_equal_fused_layer(opts):
    mha = randomize_(MultiHeadAttention(**SHAPE, **opts)).eval()
    heads = mha.heads()
    assert len(heads) == 4 and all(isinstance(h, Head) for h in heads)
    x = torch.randn(2, 8, 32, generator=gen(1))
    kpm = torch.tensor(
        [[True, True, False, False, False, False, False, False], [False] * 6 + [True, True]]
    )
    tag = "+".join(opts) or "default"
    ref = mha.proj(torch.cat([h(x) for h in heads], dim=-1))
    assert_close(mha(x), ref, f"heads() stack vs fused [{tag}]")
    ctx = context(mha, x, key_padding_mask=kpm)
    ref = mha.proj(torch.cat([h(x, ctx) for h in heads], dim=-1))
    assert_close(mha(x, ctx), ref, f"heads() stack vs fused, padded [{tag}]")
    # The heads hold copies: changing one leaves the layer untouched.
    with torch.no_grad():
        heads[0].query.weight.zero_()
    assert mha.qkv.weight[:8].abs().sum() > 0


def _torch_mha(mha: MultiHeadAttention) -> nn.MultiheadAttention:
    C = mha.config.n_embed
    ref = nn.MultiheadAttention(C, mha.n_head, bias=True, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(mha.qkv.weight)
        ref.in_proj_bias.copy_(mha.qkv.bias)
        ref.out_proj.weight.copy_(mha.proj.weight)
        ref.out_proj.bias.copy_(mha.proj.bias)
    return ref


PADDINGS = {
    "none": None,
    "right": [[False] * 8, [False] * 5 + [True] * 3],
    "left": [[True] * 3 + [False] * 5, [False] * 8],
    "middle": [[False, False, True, True, False, False, False, False], [False] * 8],
}


@pytest.mark.parametrize("padding", PADDINGS.keys())
def test_mha_equals_torch_multihead_attention(padding):
    mha = randomize_(MultiHeadAttention(**SHAPE)).eval()
    ref = _torch_mha(mha)
    x = torch.randn(2, 8, 32, generator=gen(1))
    kpm = None if PADDINGS[padding] is None else torch.tensor(PADDINGS[padding])
    causal = torch.ones(8, 8, dtype=torch.bool).triu(1)  # torch's convention: True = blocked
    y_ref, w_ref = ref(
        x,
        x,
        x,
        key_padding_mask=kpm,
        attn_mask=causal,
        need_weights=True,
        average_attn_weights=False,
    )
    # Rows whose keys are all masked are NaN in torch; ours are defined (checked below).
    rows = ~torch.isnan(y_ref).any(-1)  # (B, T)
    ctx = context(mha, x, key_padding_mask=kpm)
    y_fused = mha(x, ctx)
    y_expl, w = with_weights(mha, x, ctx)
    assert_close(y_fused[rows], y_ref[rows], f"mha fused vs torch MHA [{padding} padding]")
    assert_close(y_expl[rows], y_ref[rows], f"mha explicit vs torch MHA [{padding} padding]")
    w_rows = rows[:, None, :].expand(-1, 4, -1)  # (B, nh, T)
    assert_close(w[w_rows], w_ref[w_rows], f"mha weights vs torch MHA [{padding} padding]")
    if padding == "left":
        assert not rows.all()  # the comparison did skip torch's NaN rows
        assert_close(
            y_fused[~rows], mha.proj.bias.expand(int((~rows).sum()), -1), "empty rows == proj.bias"
        )


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_fused_equals_explicit_outputs_and_gradients(opts, padded):
    mha = randomize_(MultiHeadAttention(**SHAPE, **opts))
    x = torch.randn(2, 8, 32, generator=gen(1))
    g = torch.randn(2, 8, 32, generator=gen(2))
    kpm = torch.tensor(PADDINGS["left"]) if padded else None
    results = []
    for explicit in (False, True):
        mha.zero_grad()
        xi = x.clone().requires_grad_(True)
        ctx = context(mha, xi, key_padding_mask=kpm)
        y = with_weights(mha, xi, ctx)[0] if explicit else mha(xi, ctx)
        (y * g).sum().backward()
        grads = [p.grad.clone() for p in mha.parameters()] + [xi.grad.clone()]
        results.append((y.detach(), grads))
    tag = "+".join(opts) or "default"
    tag += ", padded" if padded else ""
    assert_close(results[0][0], results[1][0], f"fused vs explicit output [{tag}]")
    for i, (g0, g1) in enumerate(zip(results[0][1], results[1][1], strict=True)):
        assert_close(g0, g1, f"fused vs explicit grad {i} [{tag}]", atol=1e-4, rtol=1e-4)


def test_all_masked_rows_are_zero_not_nan():
    mha = randomize_(MultiHeadAttention(**SHAPE))
    x = torch.randn(2, 8, 32, generator=gen(1), requires_grad=True)
    kpm = torch.tensor([[True] * 3 + [False] * 5, [True] * 8])  # row 1: everything padding
    ctx = context(mha, x, key_padding_mask=kpm)
    for explicit in (False, True):
        y, w = with_weights(mha, x, ctx) if explicit else (mha(x, ctx), None)
        assert torch.isfinite(y).all()
        empty = torch.tensor([[True] * 3 + [False] * 5, [True] * 8])
        assert_close(
            y[empty],
            mha.proj.bias.expand(int(empty.sum()), -1),
            f"empty rows == proj.bias [{'explicit' if explicit else 'fused'}]",
            atol=0,
            rtol=0,
        )
        if explicit:
            assert (w[0, :, :3] == 0).all() and (w[1] == 0).all()
        x.grad = None
        y.sum().backward()
        assert torch.isfinite(x.grad).all()
        assert (x.grad[1] == 0).all()  # a fully padded sequence passes no gradient
    head = mha.heads()[0]
    assert (head(x, ctx)[empty] == 0).all()


def test_padded_keys_receive_no_gradient_from_real_rows():
    mha = randomize_(MultiHeadAttention(**SHAPE))
    x = torch.randn(2, 8, 32, generator=gen(1), requires_grad=True)
    kpm = torch.tensor(PADDINGS["middle"])
    y = mha(x, context(mha, x, key_padding_mask=kpm))
    y[~kpm].sum().backward()  # loss on real positions only
    assert (x.grad[kpm] == 0).all()
    assert (x.grad[~kpm] != 0).any(dim=-1).all()


def test_input_longer_than_context_raises():
    x = torch.randn(1, 9, 32)
    for layer in (MultiHeadAttention(**SHAPE), Block(**SHAPE), Head(**SHAPE)):
        with pytest.raises(ValueError, match=r"T = 9 .*context_length is 8"):
            layer(x)
    model = tiny_model()
    with pytest.raises(ValueError, match=r"T = 17 .*context_length is 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_bad_masks_raise_input_error():
    mha = MultiHeadAttention(**SHAPE)
    x = torch.randn(2, 8, 32)
    with pytest.raises(InputError, match="bool"):
        context(mha, x, key_padding_mask=torch.ones(2, 8, dtype=torch.long))
    with pytest.raises(InputError, match="shape"):
        context(mha, x, key_padding_mask=torch.zeros(2, 7, dtype=torch.bool))


# ----------------------------------------------------------------------------- recipe options


def test_rope_model_has_no_position_embedding_and_is_shift_invariant():
    model = tiny_model(pos_emb="rope")
    assert model.wpe is None
    assert all(b.attn.rotary is not None for b in model.blocks)
    idx = torch.randint(37, (2, 8), generator=gen(1))
    logits, _ = model(idx)
    # Only relative positions matter: starting at position 5 gives the same logits.
    shifted, _ = model(idx, position_ids=torch.arange(5, 13).expand(2, -1))
    assert_close(shifted, logits, "rope model shifted positions", atol=1e-4, rtol=1e-4)


def test_qk_norm_normalises_queries_and_keys():
    # The NumPy reference with normalised q, k is in test_mha_equals_numpy_per_head_formula; here:
    # scaling the query and key projections leaves the output unchanged, only with qk_norm.
    x = torch.randn(2, 8, 32, generator=gen(1))
    for qk_norm in (True, False):
        mha = randomize_(MultiHeadAttention(**SHAPE, qk_norm=qk_norm)).eval()
        y = mha(x)
        with torch.no_grad():
            mha.qkv.weight[:64] *= 7.0
            mha.qkv.bias[:64] *= 7.0
        if qk_norm:
            assert_close(mha(x), y, "qk_norm invariant to q/k scale", atol=1e-4, rtol=1e-4)
        else:
            assert not torch.allclose(mha(x), y, atol=1e-3)
    mha = randomize_(MultiHeadAttention(**SHAPE, qk_norm=True)).eval()
    y_ref, _ = numpy_mha(x, mha, qk_norm=True)
    assert_close(mha(x), y_ref, "qk_norm mha vs numpy")


def test_mlp_activations_match_formulas():
    x = torch.randn(2, 5, 16, generator=gen(1))
    for activation in ("gelu", "relu2"):
        mlp = randomize_(MLP(n_embed=16, mlp=activation))
        h = x @ mlp.fc.weight.T + mlp.fc.bias
        if activation == "gelu":  # exact (erf) GELU, GPT-2's activation_function="gelu"
            h = h * 0.5 * (1.0 + torch.special.erf(h / math.sqrt(2.0)))
        else:
            h = torch.clamp(h, min=0) ** 2
        ref = h @ mlp.proj.weight.T + mlp.proj.bias
        assert_close(mlp(x), ref, f"mlp {activation} vs formula")
        assert mlp.fc.out_features == 64


def test_tied_and_untied_lm_head():
    tied = tiny_model()
    assert tied.lm_head.weight is tied.wte.weight
    untied = tiny_model(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()
    assert untied.num_parameters() == tied.num_parameters() + 37 * 32
    assert_close(
        untied.lm_head.weight.std(), torch.tensor(0.02), "untied head init std", atol=3e-3, rtol=0
    )
    # The head's own weight drives the logits: changing it leaves the embedding alone.
    idx = torch.randint(37, (1, 8), generator=gen(1))
    before = untied.wte.weight.clone()
    logits, _ = untied(idx)
    with torch.no_grad():
        untied.lm_head.weight.mul_(2.0)
    assert_close(untied(idx)[0], 2 * logits, "untied logits scale with the head")
    assert torch.equal(untied.wte.weight, before)


# ----------------------------------------------------------------------------- Transformer


def test_matches_hf_gpt2():
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=37,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=4,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    model = tiny_model()
    hft = hf.transformer
    with torch.no_grad():
        randomize_(hf, seed=3)  # non-trivial biases and gains too
        model.wte.weight.copy_(hft.wte.weight)
        model.wpe.weight.copy_(hft.wpe.weight)
        for ours, theirs in zip(model.blocks, hft.h, strict=True):
            # Hugging Face's Conv1D stores weights as (in, out): transpose them.
            pairs = [
                (ours.ln1, theirs.ln_1),
                (ours.ln2, theirs.ln_2),
                (ours.attn.qkv, theirs.attn.c_attn),
                (ours.attn.proj, theirs.attn.c_proj),
                (ours.mlp.fc, theirs.mlp.c_fc),
                (ours.mlp.proj, theirs.mlp.c_proj),
            ]
            for a, b in pairs:
                a.weight.copy_(b.weight if isinstance(a, nn.LayerNorm) else b.weight.T)
                a.bias.copy_(b.bias)
        model.ln_f.weight.copy_(hft.ln_f.weight)
        model.ln_f.bias.copy_(hft.ln_f.bias)
    assert hf.lm_head.weight is hft.wte.weight
    idx = torch.randint(37, (2, 16), generator=gen(1))
    targets = torch.cat([idx[:, 1:], torch.full((2, 1), -1)], dim=1)
    logits, loss = model(idx, targets)
    with torch.no_grad():
        out = hf(idx, labels=idx)
    assert_close(logits, out.logits, "Transformer vs HF GPT2LMHeadModel logits")
    assert_close(loss, out.loss, "Transformer vs HF GPT2LMHeadModel loss")
    # Left padding: HF's attention_mask (1 = keep) and explicit positions.
    kpm = torch.zeros(2, 16, dtype=torch.bool)
    kpm[0, :5] = True
    pos = ((~kpm).cumsum(1) - 1).clamp(min=0)
    logits, _ = model(idx, key_padding_mask=kpm)
    with torch.no_grad():
        out = hf(idx, attention_mask=(~kpm).long(), position_ids=pos)
    assert_close(logits[~kpm], out.logits[~kpm], "Transformer vs HF GPT2 logits, left padded")


def test_causality_later_tokens_do_not_change_earlier_logits():
    model = tiny_model()
    idx = torch.randint(37, (2, 16), generator=gen(1))
    logits, _ = model(idx)
    for t in (0, 6, 14):
        changed = idx.clone()
        changed[:, t + 1 :] = torch.randint(37, (2, 15 - t), generator=gen(t))
        logits2, _ = model(changed)
        assert_close(
            logits2[:, : t + 1], logits[:, : t + 1], f"causality t={t}", atol=1e-6, rtol=1e-6
        )
        assert not torch.allclose(logits2[:, t + 1 :], logits[:, t + 1 :])


def test_reading_the_attention_patterns():
    model = tiny_model(dropout=0.1)
    idx = torch.randint(37, (2, 16), generator=gen(1))
    weights = []
    with model.hooks({f"blocks.{i}.attn.pattern": weights.append for i in range(2)}):
        logits, _ = model(idx)
    assert_close(logits, model(idx)[0], "logits with the patterns read vs forward")
    assert len(weights) == 2 and weights[0].shape == (2, 4, 16, 16)
    for w in weights:
        assert_close(w.sum(-1), torch.ones(2, 4, 16), "attention rows sum to 1")
        assert (w.triu(1) == 0).all()


def test_initial_loss_near_uniform():
    for opts in (
        {},
        {
            "pos_emb": "rope",
            "norm": "rmsnorm",
            "qk_norm": True,
            "mlp": "relu2",
            "tie_embeddings": False,
        },
    ):
        config = ModelConfig(n_layer=4, n_head=4, n_embed=128, context_length=64, **opts)
        model = Transformer(config, 65, generator=gen(0))
        idx = torch.randint(65, (4, 64), generator=gen(1))
        targets = torch.randint(65, (4, 64), generator=gen(2))
        with torch.no_grad():
            _, loss = model(idx, targets)
        print(f"initial loss {opts}: {loss.item():.4f} vs ln(65) = {math.log(65):.4f}")
        assert abs(loss.item() - math.log(65)) < 0.3


def test_loss_ignores_minus_one_targets():
    model = tiny_model()
    idx = torch.randint(37, (2, 8), generator=gen(1))
    targets = torch.randint(37, (2, 8), generator=gen(2))
    targets[:, :3] = -1
    logits, loss = model(idx, targets)
    ref = F.cross_entropy(logits[:, 3:].reshape(-1, 37), targets[:, 3:].reshape(-1))
    assert_close(loss, ref, "loss with ignored targets")


def test_eval_is_deterministic_with_dropout():
    model = tiny_model(dropout=0.3)
    idx = torch.randint(37, (2, 16), generator=gen(1))
    assert torch.equal(model(idx)[0], model(idx)[0])
    model.train()
    torch.manual_seed(0)
    assert not torch.equal(model(idx)[0], model(idx)[0])


def test_init_is_gpt2_style_and_seeded():
    config = ModelConfig(n_layer=4, n_head=4, n_embed=128, context_length=64)
    model = Transformer(config, 65, generator=gen(0))
    block = model.blocks[0]
    assert_close(block.attn.qkv.weight.std(), torch.tensor(0.02), "qkv init std", atol=1e-3, rtol=0)
    assert_close(
        block.mlp.proj.weight.std(),
        torch.tensor(0.02 / math.sqrt(8)),
        "residual proj init std",
        atol=5e-4,
        rtol=0,
    )
    assert (block.attn.qkv.bias == 0).all() and (block.ln1.weight == 1).all()
    again = Transformer(config, 65, generator=gen(0))
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)


def test_num_parameters():
    V, L, C, T = 37, 2, 32, 16
    model = tiny_model()
    per_block = (
        2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) + (4 * C * C + C)
    )
    assert model.num_parameters() == V * C + T * C + L * per_block + 2 * C
    assert model.num_parameters(non_embedding=True) == V * C + L * per_block + 2 * C
    untied = tiny_model(tie_embeddings=False, pos_emb="rope", bias=False)
    assert untied.num_parameters(non_embedding=True) == untied.num_parameters() - V * C


def test_built_from_its_config():
    cfg = ModelConfig(
        n_layer=2,
        n_head=2,
        n_embed=16,
        context_length=8,
        dropout=0.1,
        bias=False,
        pos_emb="rope",
        rope_base=500.0,
        norm="rmsnorm",
        qk_norm=True,
        mlp="relu2",
        tie_embeddings=False,
    )
    model = Transformer(cfg, vocab_size=11)
    assert (model.vocab_size, model.n_layer, model.n_head, model.n_embed, model.context_length) == (
        11,
        2,
        2,
        16,
        8,
    )
    attn = model.blocks[0].attn
    assert attn.rotary is not None and attn.qk_norm and attn.qkv.bias is None
    assert model.blocks[0].mlp.activation == "relu2" and isinstance(model.ln_f, RMSNorm)
    assert model.lm_head.weight is not model.wte.weight
    assert_close(attn.rotary.cos[1, 1], torch.tensor(math.cos(500.0 ** (-2 / 8))), "rope_base")
    logits, loss = model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    assert logits.shape == (1, 8, 11) and torch.isfinite(loss)
    default = Transformer(ModelConfig(), vocab_size=65)
    assert default.wpe is not None and default.lm_head.weight is default.wte.weight


def test_padded_batch_gradients_equal_separate_sequences():
    model = tiny_model(dropout=0.0).train()
    seqs = [torch.randint(37, (n,), generator=gen(n)) for n in (5, 9)]
    idx = torch.zeros(2, 9, dtype=torch.long)
    kpm = torch.ones(2, 9, dtype=torch.bool)
    for i, s in enumerate(seqs):
        idx[i, 9 - len(s) :] = s
        kpm[i, 9 - len(s) :] = False
    targets = torch.where(kpm, -1, torch.roll(idx, -1, dims=1))
    targets[:, -1] = -1
    model.zero_grad()
    logits, _ = model(idx, key_padding_mask=kpm)
    F.cross_entropy(
        logits.reshape(-1, 37), targets.reshape(-1), ignore_index=-1, reduction="sum"
    ).backward()
    padded_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for s in seqs:
        logits, _ = model(s[None])
        F.cross_entropy(logits[0, :-1], s[1:], reduction="sum").backward()
    for i, (a, p) in enumerate(zip(padded_grads, model.parameters(), strict=True)):
        assert_close(a, p.grad, f"padded batch grad vs separate, param {i}", atol=1e-5, rtol=1e-4)


def test_attn_dropout_sets_the_rate_on_the_attention_weights_only():
    # dropout 0.1 with attn_dropout 0: the residual output is dropped, the weights are not, so
    # the forward equals fused attention without dropout, `proj`, then F.dropout at 0.1, drawn
    # from the same generator state.
    config = ModelConfig(n_head=2, n_embed=8, context_length=6, dropout=0.1, attn_dropout=0.0)
    attn = MultiHeadAttention(config).train()
    randomize_(attn, seed=3)
    x = torch.randn(2, 6, 8, generator=gen(4))
    torch.manual_seed(0)
    y = attn(x)
    q, k, v = attn.qkv(x).view(2, 6, 3, 2, 4).unbind(2)  # each (B, T, nh, hs)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
    z = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
    torch.manual_seed(0)
    expected = F.dropout(attn.proj(z.transpose(1, 2).reshape(2, 6, 8)), 0.1)
    assert_close(y, expected, "attn_dropout 0: only the residual dropout")
    # Left null it follows `dropout`, as before; `Head` takes the same rate.
    assert ModelConfig(dropout=0.2).attention_dropout == 0.2
    assert ModelConfig(dropout=0.2, attn_dropout=0.05).attention_dropout == 0.05
    assert Head(config).dropout.p == 0.0
    assert Head(ModelConfig(n_head=2, n_embed=8, dropout=0.3)).dropout.p == 0.3
