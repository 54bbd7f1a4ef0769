"""What the model sees at each generation step: the token window of a left-padded batch and
the two context policies past `context_length`.

`ContextWindow` holds the prompts and new tokens of a batch, left-padded so that all rows end
at one column, and gives the model its inputs (token ids, key padding mask, positions that skip
the padding) for a step. Inside the context both policies prefill the KV cache once and then
feed one token per step. Past it:

- `exact` (`next_logits`): the model sees the last `context_length` tokens, recomputed every
  step (nanoGPT's semantics). Positions are absolute (learned, or rotary from 0 at the window's
  start), so once the window slides every cached key is stale.
- `shift` (`shift_logits`): when the cache is full, the last `keep` tokens are prefilled again in
  one forward pass at positions `0 .. keep - 1` and decoding goes on one token per step with the
  cache (llama.cpp's context shift for models whose positions cannot be moved in place). The
  model then sees between `keep` and `context_length` tokens, and each step is a decode step
  except one re-prefill every `context_length - keep + 1` steps.

Rotary keys could instead be rotated in place to their new positions, which equals the
re-prefill in the first layer only (deeper layers' keys also hold what the dropped tokens
contributed); the re-prefill keeps `shift` exactly "the model run on the kept tokens", which
the tests check against a plain loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from llmcli.generation.decode import Decoder
from llmcli.model.kv_cache import KVCache


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
        self.newest: Tensor | None = None  # (B,) the column appended last

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
        self.newest = next_ids
        self.end += 1


def _cached_logits(
    model: Any, window: ContextWindow, cache: KVCache, decoder: Decoder | None
) -> Tensor:
    """Logits `(B, V)`: the whole window into an empty cache, else its last column.

    A decode step goes through `decoder` where there is one and it applies now (see
    `Decoder.applies`): the same logits as the model's `forward`, without its per-step
    overhead.
    """
    end = window.end
    if window.cached == 0:  # prefill the prompts (with their padding mask)
        idx, mask, pos = window.inputs(0)
        logits, _ = model(idx, key_padding_mask=mask, position_ids=pos, kv_cache=cache)
        logits = logits[:, -1, :]  # (B, T, V) -> (B, V)
    elif decoder is not None and decoder.applies():
        logits = decoder(window.newest, cache, window.last_position())  # (B, V)
    else:  # decode one column; the cache remembers the padding
        idx, pos = window.tokens[:, end - 1 : end], window.last_position()
        logits, _ = model(idx, position_ids=pos, kv_cache=cache)
        logits = logits[:, -1, :]  # (B, 1, V) -> (B, V)
    window.cached = end
    return logits


def next_logits(
    model: Any, window: ContextWindow, cache: KVCache | None, decoder: Decoder | None = None
) -> Tensor:
    """`exact`: logits `(B, V)` of the token after column `end - 1`."""
    C = model.context_length
    end = window.end
    if cache is not None and end <= C:
        return _cached_logits(model, window, cache, decoder)
    # No cache, or past the context: the model sees the last C columns, recomputed.
    idx, mask, pos = window.inputs(max(0, end - C))
    logits, _ = model(idx, key_padding_mask=mask, position_ids=pos)
    return logits[:, -1, :]  # (B, T, V) -> (B, V)


def shift_logits(
    model: Any,
    window: ContextWindow,
    cache: KVCache | None,
    keep: int,
    decoder: Decoder | None = None,
) -> Tensor:
    """`shift`: logits `(B, V)` of the token after column `end - 1`.

    When the newest column does not fit in the context, the window starts again from the rows'
    last tokens (`ContextWindow.keep_last`) and the cache is emptied, so this step prefills the
    kept tokens. Without a cache the same window is recomputed every step (same tokens, slower).
    """
    if window.end > model.context_length:
        window.keep_last(keep)
        if cache is not None:
            cache.reset()
    if cache is not None:
        return _cached_logits(model, window, cache, decoder)
    idx, mask, pos = window.inputs(0)
    logits, _ = model(idx, key_padding_mask=mask, position_ids=pos)
    return logits[:, -1, :]  # (B, T, V) -> (B, V)
