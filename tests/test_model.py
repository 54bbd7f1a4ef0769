"""Tests that pin the model's maths against references.

References: a NumPy float64 implementation of the per-head formula, a stack of `Head`s,
`torch.nn.MultiheadAttention`, and Hugging Face `GPT2LMHeadModel`, each also under an attention
mask built for padding (`llmcli.generation.engine`, or by hand). Everything runs in fp32 at tiny
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
    gen,
    left_padded,
    numpy_rope,
    randomize_,
    tiny_model,
    with_weights,
)
from torch import nn

from llmcli.config import ModelConfig
from llmcli.errors import InputError
from llmcli.generation.engine import padded_mask, padded_positions
from llmcli.model import MLP, Block, Head, MultiHeadAttention, Transformer, causal_mask
from llmcli.model.heads import fuse_heads, split_heads
from llmcli.model.kv_cache import KVCache
from llmcli.model.layers import RMSNorm

OPTIONS = {
    "default": {},
    "rope+qknorm": {"pos_emb": "rope", "qk_norm": True},
}
SHAPE = {"n_head": 4, "n_embed": 32, "context_length": 8}  # the seed's example layer


def padding_mask(padding: list[list[bool]]) -> torch.Tensor:
    """The attention mask of rows whose keys `padding` marks (True = padding), by hand:
    `(B, 1, T, T)` bool, True = may attend; causal, no padding key, a padding query on itself
    (so no row is empty: the model needs every query to see a key)."""
    pad = torch.tensor(padding)  # (B, T)
    T = pad.shape[1]
    allowed = causal_mask(T, T) & ~pad[:, None, :] | torch.eye(T, dtype=torch.bool)  # (B, T, T)
    return allowed[:, None]  # (B, 1, T, T)


# ----------------------------------------------------------------------------- NumPy reference


def numpy_mha(x, mha: MultiHeadAttention, pos_emb="learned", qk_norm=False, mask=None, pos=None):
    """The per-head formula in float64: softmax(QK^T/sqrt(hs)) under `mask` `(B, 1, T, T)` (None:
    causal), @V, cat, proj; rotary positions `pos` `(B, T)` (None: 0 .. T - 1)."""
    x = x.detach().double().numpy()
    W = mha.qkv.weight.detach().double().numpy()
    b = mha.qkv.bias.detach().double().numpy()
    Wp = mha.proj.weight.detach().double().numpy()
    bp = mha.proj.bias.detach().double().numpy()
    B, T, C = x.shape
    nh = mha.n_head
    hs = C // nh
    qkv = x @ W.T + b  # (B, T, 3C)
    mask = np.tril(np.ones((1, T, T), dtype=bool)) if mask is None else mask[:, 0].numpy()
    pos = np.tile(np.arange(T), (B, 1)) if pos is None else pos.numpy()
    outs, weights = [], []
    for h in range(nh):
        q = qkv[..., h * hs : (h + 1) * hs]
        k = qkv[..., C + h * hs : C + (h + 1) * hs]
        v = qkv[..., 2 * C + h * hs : 2 * C + (h + 1) * hs]
        if qk_norm:
            q = q / np.sqrt((q**2).mean(-1, keepdims=True) + 1e-5)
            k = k / np.sqrt((k**2).mean(-1, keepdims=True) + 1e-5)
        if pos_emb == "rope":  # each row rotated by its own positions
            q = np.stack([numpy_rope(q[b], pos[b]) for b in range(B)])
            k = np.stack([numpy_rope(k[b], pos[b]) for b in range(B)])
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
    # Left padding, as generation builds it: the mask and the positions of real tokens.
    pads = torch.tensor([3, 0])
    mask, pos = padded_mask(pads, 8, 8), padded_positions(pads, 8, 8)
    y_ref, w_ref = numpy_mha(x, mha, **opts, mask=mask, pos=pos)
    assert_close(mha(x, mask, pos), y_ref, f"mha fused vs numpy, left padded [{tag}]")
    y, w = with_weights(mha, x, mask, pos)
    assert_close(y, y_ref, f"mha explicit vs numpy, left padded [{tag}]")
    assert_close(w, w_ref, f"mha weights vs numpy, left padded [{tag}]")


@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_fuse_heads_equals_stack_of_heads(opts):
    torch.manual_seed(0)
    heads = [Head(**SHAPE, bias=False, **opts) for _ in range(4)]  # proj's bias alone
    proj = nn.Linear(32, 32)
    x = torch.randn(2, 8, 32, generator=gen(1))
    ref = proj(torch.cat([h(x) for h in heads], dim=-1))
    mha = fuse_heads(heads, proj)
    tag = "+".join(opts) or "default"
    assert_close(mha(x), ref, f"fuse_heads vs stack of Heads [{tag}]")


@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_heads_equal_fused_layer(opts):
    mha = randomize_(MultiHeadAttention(**SHAPE, **opts)).eval()
    heads = split_heads(mha)
    assert len(heads) == 4 and all(isinstance(h, Head) for h in heads)
    x = torch.randn(2, 8, 32, generator=gen(1))
    # Padding at the start of row 0 and at the end of row 1 (a mask built by hand).
    mask = padding_mask([[True, True] + [False] * 6, [False] * 6 + [True, True]])
    tag = "+".join(opts) or "default"
    ref = mha.proj(torch.cat([h(x) for h in heads], dim=-1))
    assert_close(mha(x), ref, f"split_heads stack vs fused [{tag}]")
    ref = mha.proj(torch.cat([h(x, mask) for h in heads], dim=-1))
    assert_close(mha(x, mask), ref, f"split_heads stack vs fused, padded [{tag}]")
    assert not torch.allclose(mha(x, mask), mha(x))  # the mask did change the result
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
    if PADDINGS[padding] is None:
        mask = None  # the model's own causal mask
        blocked = torch.ones(8, 8, dtype=torch.bool).triu(1)  # torch's convention: True = blocked
    else:
        mask = padding_mask(PADDINGS[padding])  # (B, 1, T, T), True = may attend
        blocked = ~mask.expand(-1, 4, -1, -1).reshape(2 * 4, 8, 8)  # (B * nh, T, T)
    y_ref, w_ref = ref(
        x, x, x, attn_mask=blocked, need_weights=True, average_attn_weights=False
    )  # (B, T, C), (B, nh, T, T)
    assert torch.isfinite(y_ref).all()  # every query sees a key: no NaN row in torch either
    y_fused = mha(x, mask)
    y_expl, w = with_weights(mha, x, mask)
    assert_close(y_fused, y_ref, f"mha fused vs torch MHA [{padding} padding]")
    assert_close(y_expl, y_ref, f"mha explicit vs torch MHA [{padding} padding]")
    assert_close(w, w_ref, f"mha weights vs torch MHA [{padding} padding]")
    if padding == "none":
        return
    # Torch's own padding: its key_padding_mask beside the causal mask. Real queries see what
    # they see under our mask (a padding query differs: ours sees itself, torch's its past).
    pad = torch.tensor(PADDINGS[padding])  # (B, T), True = padding
    causal_blocked = torch.ones(8, 8, dtype=torch.bool).triu(1)
    y_kpm, w_kpm = ref(
        x,
        x,
        x,
        key_padding_mask=pad,
        attn_mask=causal_blocked,
        need_weights=True,
        average_attn_weights=False,
    )
    real = ~pad
    assert_close(y_fused[real], y_kpm[real], f"mha vs torch MHA key_padding_mask [{padding}]")
    w_real = real[:, None, :].expand(-1, 4, -1)  # (B, nh, T)
    assert_close(w[w_real], w_kpm[w_real], f"weights vs torch key_padding_mask [{padding}]")
    if padding == "left":  # the hand-built mask is the one generation builds
        assert torch.equal(mask, padded_mask(torch.tensor([3, 0]), 8, 8))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_fused_equals_explicit_outputs_and_gradients(opts, padded):
    mha = randomize_(MultiHeadAttention(**SHAPE, **opts))
    x = torch.randn(2, 8, 32, generator=gen(1))
    g = torch.randn(2, 8, 32, generator=gen(2))
    pads = torch.tensor([3, 0])
    mask = padded_mask(pads, 8, 8) if padded else None
    pos = padded_positions(pads, 8, 8) if padded else None
    results = []
    for explicit in (False, True):
        mha.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = with_weights(mha, xi, mask, pos)[0] if explicit else mha(xi, mask, pos)
        (y * g).sum().backward()
        grads = [p.grad.clone() for p in mha.parameters()] + [xi.grad.clone()]
        results.append((y.detach(), grads))
    tag = "+".join(opts) or "default"
    tag += ", padded" if padded else ""
    assert_close(results[0][0], results[1][0], f"fused vs explicit output [{tag}]")
    for i, (g0, g1) in enumerate(zip(results[0][1], results[1][1], strict=True)):
        assert_close(g0, g1, f"fused vs explicit grad {i} [{tag}]", atol=1e-4, rtol=1e-4)


def test_a_padding_query_attends_to_itself_alone_so_nothing_is_nan():
    """A padding query has no real key at or before it; `padded_mask` lets it see itself, so its
    softmax row is one-hot, not empty (which would be NaN): its output is its own value through
    `proj`, finite, and so are the gradients. Row 1 is padding throughout."""
    mha = randomize_(MultiHeadAttention(**SHAPE))
    x = torch.randn(2, 8, 32, generator=gen(1), requires_grad=True)
    mask = padded_mask(torch.tensor([3, 8]), 8, 8)
    pad = torch.tensor([[True] * 3 + [False] * 5, [True] * 8])  # (B, T) the padding queries
    own_value = mha.proj(mha.qkv(x)[..., 64:])  # (B, T, C): attending to itself alone
    for explicit in (False, True):
        y, w = with_weights(mha, x, mask) if explicit else (mha(x, mask), None)
        assert torch.isfinite(y).all()
        name = f"padding query == its own value [{'explicit' if explicit else 'fused'}]"
        assert_close(y[pad], own_value[pad], name)
        if explicit:
            eye = torch.eye(8).expand(4, -1, -1)  # (nh, T, T)
            assert torch.equal(w[1], eye) and torch.equal(w[0, :, :3], eye[:, :3])
        x.grad = None
        y.sum().backward()
        assert torch.isfinite(x.grad).all()
    head = split_heads(mha)[0]
    assert_close(head(x, mask)[pad], head.value(x)[pad], "Head: padding query == its value")
    model = randomize_(tiny_model())  # the whole model on a row of padding only
    idx = torch.randint(37, (2, 16), generator=gen(2))
    pads = torch.tensor([16, 5])
    logits, _ = model(idx, mask=padded_mask(pads, 16, 16), input_pos=padded_positions(pads, 16, 16))
    assert torch.isfinite(logits).all()


def test_padded_keys_receive_no_gradient_from_real_rows():
    mha = randomize_(MultiHeadAttention(**SHAPE))
    x = torch.randn(2, 8, 32, generator=gen(1), requires_grad=True)
    pad = torch.tensor(PADDINGS["middle"])
    y = mha(x, padding_mask(PADDINGS["middle"]))
    y[~pad].sum().backward()  # loss on real positions only
    assert (x.grad[pad] == 0).all()
    assert (x.grad[~pad] != 0).any(dim=-1).all()


def test_input_longer_than_context_raises():
    model = tiny_model()
    with pytest.raises(InputError, match=r"T = 17 .*context_length is 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    cache = model.new_kv_cache(1)
    model(torch.zeros(1, 10, dtype=torch.long), kv_cache=cache)
    with pytest.raises(InputError, match=r"T = 7 positions after 10 cached .*last 6 tokens"):
        model(torch.zeros(1, 7, dtype=torch.long), kv_cache=cache)
    assert cache.length == 10


LAYERS = {
    "head": (Head, 32 // 4),
    "mha": (MultiHeadAttention, 32),
    "block": (Block, 32),
}


@pytest.mark.parametrize("layer, width", LAYERS.values(), ids=LAYERS.keys())
def test_a_layer_refuses_more_positions_than_its_context(layer, width):
    module = randomize_(layer(**SHAPE)).eval()  # context_length 8
    with pytest.raises(ValueError, match=r"^input has 9 positions but context_length is 8\b"):
        module(torch.randn(1, 9, 32, generator=gen(1)))
    x = torch.randn(2, 8, 32, generator=gen(1))
    y = module(x)  # exactly context_length: accepted, and causal as with fewer positions
    assert y.shape == (2, 8, width) and y.isfinite().all()
    assert_close(y[:, :7], module(x[:, :7]), f"{layer.__name__} at 8 vs 7 positions")


def test_a_rotary_layer_alone_refuses_positions_past_its_context():
    # A cached layer sees few new tokens at later positions; the rotary tables end at
    # context_length, so positions 5..8 are refused though T = 4 is within it.
    mha = MultiHeadAttention(n_head=4, n_embed=32, context_length=8, pos_emb="rope")
    cache = KVCache(1, 1, 4, 8, 16)  # room for more than the context: the rotary table refuses
    mha(torch.randn(1, 5, 32), kv_cache=cache)
    cache.advance(5)
    with pytest.raises(InputError, match=r"rotary positions 5\.\.8 .*context_length \(8\)"):
        mha(torch.randn(1, 4, 32), kv_cache=cache)
    assert mha(torch.randn(1, 3, 32), kv_cache=cache).shape == (1, 3, 32)  # 5..7 fit


def test_an_integer_mask_is_refused_not_read_as_bool():
    """A 0/1 integer mask (Hugging Face's `attention_mask`, 1 = keep) is refused on both paths,
    never silently taken for the bool mask; the bool mask means True = may attend (SDPA's)."""
    mha = randomize_(MultiHeadAttention(**SHAPE)).eval()
    x = torch.randn(2, 8, 32, generator=gen(1))
    ones = torch.ones(8, 8, dtype=torch.long).tril()
    with pytest.raises(RuntimeError):
        mha(x, ones)
    with pytest.raises(RuntimeError):
        with_weights(mha, x, ones)
    assert_close(mha(x, ones.bool()), mha(x), "the bool causal mask == the default")


def test_a_float_mask_is_added_to_the_scores_on_both_paths():
    """SDPA takes an additive float mask; the explicit path (a hook at `pattern`) does the same,
    so reading the weights does not change what a mask means."""
    mha = randomize_(MultiHeadAttention(**SHAPE)).eval()
    x = torch.randn(2, 8, 32, generator=gen(1))
    bias = torch.randn(8, 8, generator=gen(2)).masked_fill(~torch.ones(8, 8).tril().bool(), -1e9)
    fused = mha(x, bias)
    explicit, weights = with_weights(mha, x, bias)
    assert_close(explicit, fused, "float mask: explicit vs fused")
    assert_close(weights.sum(-1), torch.ones(2, 4, 8), "rows sum to 1")


# ----------------------------------------------------------------------------- recipe options


def test_rope_model_has_no_position_embedding_and_is_shift_invariant():
    model = tiny_model(pos_emb="rope")
    assert model.wpe is None
    assert all(b.attn.rotary is not None for b in model.blocks)
    idx = torch.randint(37, (2, 8), generator=gen(1))
    logits, _ = model(idx)
    # Only relative positions matter: starting at position 5 gives the same logits.
    shifted, _ = model(idx, input_pos=torch.arange(5, 13).expand(2, -1))
    assert_close(shifted, logits, "rope model shifted positions", atol=1e-4, rtol=1e-4)
    shifted, _ = model(idx, input_pos=torch.arange(5, 13))  # (T,): the same for every row
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
    # Left padding: our mask and positions against HF's attention_mask (1 = keep) and
    # position_ids, counted by hand.
    pads = torch.tensor([5, 0])
    real = torch.arange(16)[None, :] >= pads[:, None]  # (B, T)
    pos = (real.cumsum(1) - 1).clamp(min=0)  # (B, T)
    assert torch.equal(padded_positions(pads, 16, 16), pos)
    logits, _ = model(idx, mask=padded_mask(pads, 16, 16), input_pos=pos)
    with torch.no_grad():
        out = hf(idx, attention_mask=real.long(), position_ids=pos)
    assert_close(logits[real], out.logits[real], "Transformer vs HF GPT2 logits, left padded")


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
    idx, pads = left_padded(seqs)
    pad = torch.arange(9)[None, :] < pads[:, None]  # (B, T)
    targets = torch.where(pad, -1, torch.roll(idx, -1, dims=1))
    targets[:, -1] = -1
    model.zero_grad()
    logits, _ = model(idx, mask=padded_mask(pads, 9, 9), input_pos=padded_positions(pads, 9, 9))
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
