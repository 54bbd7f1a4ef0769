"""Tests for llmcli.inspection.capture: capture against plain PyTorch, and prompts captured in
right-padded batches against each prompt alone."""

from __future__ import annotations

import torch
from attention_helpers import CTX, build_model

from llmcli.inspection.capture import capture_attention, capture_prompts


def test_captured_logits_equal_normal_forward() -> None:
    _, tok, model = build_model(dropout=0.3)
    idx = torch.tensor([tok.encode("Speak, speak. You")[:CTX]])
    model.train()  # capture must switch dropout off by itself, and restore the mode
    logits, attn = capture_attention(model, idx)
    assert model.training
    model.eval()
    with torch.no_grad():
        expected, _ = model(idx)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert attn.shape == (1, 2, 4, idx.shape[1], idx.shape[1])


def test_weights_equal_torch_multihead_attention() -> None:
    """Every layer's per-head weights equal nn.MultiheadAttention's on that layer's input."""
    _, tok, model = build_model()
    idx = torch.tensor([tok.encode("Before we procee"), tok.encode("You are all reso")])
    inputs = []
    hooks = [
        block.attn.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
        for block in model.blocks
    ]
    _, attn = capture_attention(model, idx)  # (B, L, H, T, T)
    for h in hooks:
        h.remove()
    T = idx.shape[1]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)  # True = not allowed
    for layer, (block, x) in enumerate(zip(model.blocks, inputs, strict=True)):
        mha = torch.nn.MultiheadAttention(32, 4, bias=True, batch_first=True)
        with torch.no_grad():
            mha.in_proj_weight.copy_(block.attn.qkv.weight)
            mha.in_proj_bias.copy_(block.attn.qkv.bias)
            mha.out_proj.weight.copy_(block.attn.proj.weight)
            mha.out_proj.bias.copy_(block.attn.proj.bias)
        mha.eval()
        with torch.no_grad():
            _, per_head = mha(
                x, x, x, attn_mask=future, need_weights=True, average_attn_weights=False
            )  # (B, H, T, T)
            _, averaged = mha(
                x, x, x, attn_mask=future, need_weights=True, average_attn_weights=True
            )  # (B, T, T)
        torch.testing.assert_close(attn[:, layer], per_head, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(attn[:, layer].mean(1), averaged, rtol=1e-5, atol=1e-6)
        # The heads really differ: the average hides something.
        assert (attn[:, layer] - attn[:, layer].mean(1, keepdim=True)).abs().max() > 0.05


def test_prompts_in_right_padded_batches_equal_each_alone() -> None:
    """Right padding needs no mask: every pad key comes after every real query, so the causal
    mask hides it, and a prompt's positions are those it has alone."""
    _, tok, model = build_model()
    prompts = [tok.encode(p) for p in ("Speak", "Before we procee", "All:\nRes", "Y")]
    captured = capture_prompts(model, prompts, batch_size=3)  # batches of 3 and 1
    assert len(captured) == len(prompts)
    for ids, (logits, attn) in zip(prompts, captured, strict=True):
        alone_logits, alone_attn = capture_attention(model, torch.tensor([ids]))
        assert logits.shape == (len(ids), tok.vocab_size)
        assert attn.shape == (2, 4, len(ids), len(ids))
        torch.testing.assert_close(logits, alone_logits[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(attn, alone_attn[0], rtol=1e-5, atol=1e-6)
