"""The plain sampling loop, as nanoGPT's `GPT.generate` writes it: crop the sequence to its last
`context_length` tokens, run the model's forward on that window, keep the last position's
logits, draw the next token (`llmcli.generation.sampling.sample_next`), append it, repeat.

No KV cache and no padding: one prompt, or a batch of prompts of one length, recomputed in full
at every step. This is the loop to read. `llmcli.generation.engine` draws the same tokens faster
(a KV cache, left-padded batches of prompts of different lengths, the `shift` policy past the
context) and is what `llmcli sample` and `llmcli serve` run; the tests check it token for token
against this loop under its `exact` context policy, which is this loop's sliding window.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmcli.generation.sampling import sample_next
from llmcli.model.gpt import Transformer


@torch.no_grad()
def generate(
    model: Transformer,
    idx: Tensor,
    max_new_tokens: int,
    generator: torch.Generator | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> Tensor:
    """Continue the prompts `idx` `(B, T)`, all of one length, by `max_new_tokens` tokens, one
    full forward per token. Returns `(B, T + max_new_tokens)`: the prompts, then the new tokens.

    `generator` gives the draws' random numbers (advanced in place; None: torch's global one;
    unused at temperature 0, greedy); `temperature`, `top_k`, `top_p`: see `sample_next`.
    """
    for _ in range(max_new_tokens):
        # The model sees at most context_length tokens: past it, the window slides.
        idx_cond = idx[:, -model.context_length :]  # (B, T'), T' <= context_length
        logits, _ = model(idx_cond)  # (B, T', V)
        logits = logits[:, -1, :]  # (B, V): the scores of the token after the window
        idx_next = sample_next(logits, generator, temperature, top_k, top_p)  # (B,)
        idx = torch.cat((idx, idx_next[:, None]), dim=1)  # (B, T + 1)
    return idx
