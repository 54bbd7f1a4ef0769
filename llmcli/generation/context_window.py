"""What the model sees at each generation step: the token window of a left-padded batch, and
the two context policies past `context_length`.

`ContextWindow` holds the prompts and new tokens of a batch, left-padded so that all rows end
at one column (`llmcli.generation.padding`), and gives the model its inputs for a step (token
ids, attention mask, positions). Inside the context both policies prefill the KV cache once and
then feed one token per step (`llmcli.generation.generate.next_logits`). Past it:

- `exact`: the model sees the last `context_length` tokens, recomputed every step (nanoGPT's
  semantics). Positions are absolute (learned, or rotary from 0 at the window's start), so once
  the window slides every cached key is stale.
- `shift`: when the cache is full, the last `keep` tokens are prefilled again in one forward pass
  at positions `0 .. keep - 1` and decoding goes on one token per step with the cache (llama.cpp's
  context shift for models whose positions cannot be moved in place). The model then sees between
  `keep` and `context_length` tokens, and each step is a decode step except one re-prefill every
  `context_length - keep + 1` steps.

Rotary keys could instead be rotated in place to their new positions, which equals the
re-prefill in the first layer only (deeper layers' keys also hold what the dropped tokens
contributed); the re-prefill keeps `shift` exactly "the model run on the kept tokens", which
the tests check against a plain loop.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmcli.generation.padding import padded_mask, padded_positions


class ContextWindow:
    """The token buffer of a left-padded batch and the model inputs for each step.

    Row `b` holds `pads[b]` padding columns, its prompt, then its new tokens; all rows end at
    column `end`. The buffer is preallocated, so a step only writes one column; for long
    generations it holds `P + 2 * context_length` columns and drops the columns the model can
    no longer see when it is full.
    """

    def __init__(
        self, rows: list[list[int]], max_new_tokens: int, context_length: int, device: torch.device
    ) -> None:
        B = len(rows)
        lengths = [len(r) for r in rows]
        P = max(lengths)
        self.context_length = context_length
        self.pads = [P - n for n in lengths]
        self.max_pad = max(self.pads)
        capacity = P + min(max_new_tokens, 2 * context_length)
        tokens = torch.zeros(B, capacity, dtype=torch.long)  # (B, capacity)
        for b, row in enumerate(rows):
            tokens[b, self.pads[b] : P] = torch.tensor(row, dtype=torch.long)
        self.tokens = tokens.to(device)
        self.pads_t = torch.tensor(self.pads, device=device)  # (B,)
        self.end = P  # columns filled
        self.cached = 0  # columns whose keys/values are in the KV cache

    def inputs(self, start: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """`(idx, mask, input_pos)` for the columns `start .. end - 1`, as a window of its own:
        position 0 at each row's first real token, earlier columns masked (None, None without
        padding in the window: the model's causal defaults)."""
        idx = self.tokens[:, start : self.end]  # (B, W)
        if self.max_pad <= start:
            return idx, None, None
        W = self.end - start
        pads = (self.pads_t - start).clamp(min=0)  # (B,) padding columns in the window
        return idx, padded_mask(pads, W, W), padded_positions(pads, W, W)

    def newest_inputs(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """`(idx (B, 1), mask, input_pos)` of column `end - 1` after the cached columns before
        it (None, None without padding)."""
        idx = self.tokens[:, self.end - 1 : self.end]  # (B, 1)
        if self.max_pad == 0:
            return idx, None, None
        pads = self.pads_t
        return idx, padded_mask(pads, 1, self.end), padded_positions(pads, 1, self.end)

    def keep_last(self, keep: int) -> None:
        """Start the window again from each row's last tokens, as `shift` does when it is full.

        A row with more real tokens than `context_length` (it would shift alone now) keeps its
        last `keep`; a shorter row keeps all of its own, as it would alone. The kept tokens are
        right-aligned at the new `end`; columns before a row's kept tokens count as padding from
        then on, so the kept ones take positions `0 ..` again.
        """
        C = self.context_length
        kept = [keep if self.end - p > C else self.end - p for p in self.pads]
        W = max(kept)
        self.tokens[:, :W] = self.tokens[:, self.end - W : self.end].clone()
        self.pads = [W - k for k in kept]
        self.max_pad = max(self.pads)
        self.pads_t = torch.tensor(self.pads, device=self.tokens.device)
        self.end = W
        self.cached = 0

    def append(self, next_ids: Tensor) -> None:
        if self.end == self.tokens.shape[1]:
            # Full: keep the last context_length columns (here end > context_length, so the
            # cache is no longer in use and nothing older can be seen again).
            shift = self.end - self.context_length
            self.tokens[:, : self.context_length] = self.tokens[:, shift:].clone()
            self.pads = [max(0, p - shift) for p in self.pads]
            self.max_pad = max(self.pads)
            self.pads_t = (self.pads_t - shift).clamp(min=0)
            self.end = self.context_length
        self.tokens[:, self.end] = next_ids  # (B,)
        self.end += 1
