"""Capture attention: run a model and record the softmax weights of every layer and head.

`capture_attention` reads every layer's `attn.pattern` hook point, and `capture_prompts` runs
prompts of different lengths through it in batches. (The repeated-random-token probe reads the
same hook points on its own: `llmcli.evaluation.probe`.)

Several prompts are captured in one right-padded batch. With right padding every real query sits
before every pad key, so the causal mask alone hides the padding from real tokens, and their
positions are those they have alone; each result is then sliced to its own prompt's length, so
padding never appears in a dump (a test checks each dump equals the prompt run alone).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: How many prompts run through the model in one padded batch.
BATCH_PROMPTS = 16


def capture_attention(
    model: torch.nn.Module, idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the model in eval mode (dropout off) and record every layer's per-head weights.

    Reads the `blocks.{l}.attn.pattern` hook points, which makes every layer compute its weights
    explicitly; the logits are those of the normal forward (a test checks it). The model's
    train/eval mode is restored.

    Args:
        model: a `llmcli.model.gpt.Transformer`.
        idx: token ids `(B, T)`, T <= context_length.

    Returns:
        logits `(B, T, vocab)` and attention `(B, L, H, T, T)` (query x key), both float32 CPU.
    """
    weights: list[torch.Tensor] = []
    patterns = {f"blocks.{i}.attn.pattern": weights.append for i in range(model.n_layer)}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), model.hooks(patterns):
            logits, _ = model(idx)
    finally:
        model.train(was_training)
    attn = torch.stack(weights, dim=1)  # L x (B, H, T, T) -> (B, L, H, T, T)
    return logits.float().cpu(), attn.float().cpu()


def capture_prompts(
    model: torch.nn.Module, prompts_ids: Sequence[Sequence[int]], batch_size: int = BATCH_PROMPTS
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Capture prompts of different lengths in right-padded batches; return each unpadded.

    Right padding puts every pad after every real token, so under the causal mask no real query
    can see a pad key, and a prompt's positions are those it has alone. Each result is sliced
    back to its own length.

    Returns:
        For each prompt, `(logits (T, V), attn (L, H, T, T))` with T its own length.
    """
    device = next(model.parameters()).device
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for start in range(0, len(prompts_ids), batch_size):
        chunk = prompts_ids[start : start + batch_size]
        T = max(len(ids) for ids in chunk)
        idx = torch.zeros(len(chunk), T, dtype=torch.long)  # (B, T), pads are token 0
        for b, ids in enumerate(chunk):
            idx[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        logits, attn = capture_attention(model, idx.to(device))
        for b, ids in enumerate(chunk):
            n = len(ids)
            out.append((logits[b, :n], attn[b, :, :, :n, :n]))  # (n, V), (L, H, n, n)
    return out
