"""What the model sees at each generation step: the token window of a left-padded batch.

`ContextWindow` holds the prompts and new tokens of a batch, left-padded so that all rows end
at one column, and gives the model its inputs (token ids, key padding mask, positions that skip
the padding) for a step. `next_logits` runs one step: prefill or one cached token inside the
context, the last `context_length` tokens recomputed past it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


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
        self.cols = torch.arange(capacity, device=device)  # (capacity,)
        self.pads_t = torch.tensor(self.pads, device=device)  # (B,)
        self.end = P  # columns filled
        self.cached = 0  # columns whose keys/values are in the KV cache

    def inputs(self, start: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """`(idx, key_padding_mask, position_ids)` for the columns `start .. end - 1`, as a
        window of its own: position 0 at its first real token, earlier columns masked."""
        idx = self.tokens[:, start : self.end]  # (B, W)
        if self.max_pad <= start:  # no padding left in the window: the model's defaults
            return idx, None, None
        W = self.end - start
        pads = (self.pads_t - start).clamp(min=0)[:, None]  # (B, 1) padding columns in window
        cols = self.cols[:W][None, :]  # (1, W)
        return idx, cols < pads, (cols - pads).clamp(min=0)  # (B, W) each

    def last_position(self) -> Tensor | None:
        """`(B, 1)` position of column `end - 1` (None without padding: the cache length)."""
        if self.max_pad == 0:
            return None
        return (self.end - 1 - self.pads_t).clamp(min=0)[:, None]  # (B, 1)

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


def next_logits(model: Any, window: ContextWindow, cache: Any) -> Tensor:
    """Logits `(B, V)` of the token after column `end - 1`."""
    C = model.context_length
    end = window.end
    if cache is not None and end <= C:
        if window.cached == 0:  # prefill the prompts (with their padding mask)
            idx, mask, pos = window.inputs(0)
        else:  # decode one column; the cache remembers the padding
            idx, mask, pos = window.tokens[:, end - 1 : end], None, window.last_position()
        logits, _ = model(idx, key_padding_mask=mask, position_ids=pos, kv_cache=cache)
        window.cached = end
    else:
        # No cache, or past the context: the model sees the last C columns, recomputed.
        idx, mask, pos = window.inputs(max(0, end - C))
        logits, _ = model(idx, key_padding_mask=mask, position_ids=pos)
    return logits[:, -1, :]  # (B, T, V) -> (B, V)
