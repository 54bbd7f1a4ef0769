"""Sequences packed whole into rows of the context, each attending only to itself: the
block-diagonal causal mask and each sequence's own positions (what packed chat SFT trains on),
and a batch of rows cut to their longest (DPO's pairs, GRPO's completions) packed that way
when it reads fewer positions so (`Packing`, `packing_for`).

A row packed among others computes what it computes alone: its tokens see only its own earlier
tokens, at positions counted from its start, so its logits are the same up to the last bits of
the sums (`tests/test_packing.py` holds DPO's scores within 1e-6).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

from llmcli.data.chat_batches import best_fit
from llmcli.model.gpt import causal_mask

#: Packing pays when it leaves out at least this share of the positions of the rows cut to their
#: longest: its masked attention costs more per position than the causal one. On DPO's
#: benchmark batch (`benchmarks/post_training_vs_trl.py`), 512 packed positions against 624 cut
#: (18% fewer) took 0.85-0.88x the forward and backward on the CPU.
MIN_SAVING = 0.1


def segment_mask(segments: Tensor) -> Tensor:
    """Who may attend to whom: `(B, T)` segment ids -> `(B, 1, T, T)` bool, True where the
    key is at or before the query and in the same segment (padding, one segment, attends
    within itself, so that every query has a key)."""
    T = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]  # (B, T, T)
    causal = causal_mask(T, T, segments.device)  # (T, T)
    return (same & causal).unsqueeze(1)  # (B, 1, T, T)


def segment_positions(segments: Tensor) -> Tensor:
    """Each position counted from its segment's first: `(B, T)` segment ids -> `(B, T)` long."""
    B, T = segments.shape
    t = torch.arange(T, device=segments.device).expand(B, T)  # (B, T)
    first = torch.ones_like(segments, dtype=torch.bool)  # (B, T)
    first[:, 1:] = segments[:, 1:] != segments[:, :-1]
    start = torch.where(first, t, 0).cummax(dim=1).values  # (B, T): its segment's first
    return t - start


@dataclass
class Packing:
    """Where each position of `R` rows of width `L` (each row's first `lengths[r]` positions
    real, the rest padding) goes in `P` packed rows of the context.

    Attributes:
        index: `(P, T)` long, each packed position's index into the flattened `(R * L)` rows
            (0 on padding, which `real` marks).
        real: `(P, T)` bool, False on a packed row's padding.
        segments: `(P, T)` long, a packed row's sequences 1, 2, ... and 0 on its padding.
        shape: `(R, L)`, the rows packed.
    """

    index: Tensor
    real: Tensor
    segments: Tensor
    shape: tuple[int, int]

    @staticmethod
    def plan(lengths: list[int], width: int, context: int, device: torch.device) -> Packing | None:
        """The rows' sequences packed whole (best fit, `llmcli.data.chat_batches.best_fit`) into
        rows of `context` positions; None when that leaves out less than `MIN_SAVING` of the
        `len(lengths) x width` positions."""
        placed, left = best_fit(lengths, len(lengths), context)
        assert not left, "a row longer than the context"
        placed = [items for items in placed if items]
        if len(placed) * context > (1 - MIN_SAVING) * len(lengths) * width:
            return None
        index = torch.zeros((len(placed), context), dtype=torch.long)
        segments = torch.zeros((len(placed), context), dtype=torch.long)
        for p, items in enumerate(placed):
            at = 0
            for segment, r in enumerate(items, start=1):
                n = lengths[r]
                index[p, at : at + n] = torch.arange(r * width, r * width + n)
                segments[p, at : at + n] = segment
                at += n
        segments = segments.to(device)
        return Packing(index.to(device), segments != 0, segments, (len(lengths), width))

    def pack(self, rows: Tensor, fill: float | int = 0) -> Tensor:
        """`(R, L)` -> `(P, T)`: the rows' real positions where the packing puts them."""
        return torch.where(self.real, rows.reshape(-1)[self.index], fill)

    def unpack(self, packed: Tensor, fill: float = 0.0) -> Tensor:
        """`(P, T)` -> `(R, L)`: each real position back in its row, `fill` on padding."""
        out = packed.new_full((self.shape[0] * self.shape[1],), fill)
        out = out.index_put((self.index[self.real],), packed[self.real])
        return out.view(self.shape)

    @cached_property
    def attention(self) -> tuple[Tensor, Tensor]:
        """The packed rows' mask and positions (`segment_mask`, `segment_positions`), made once
        for every model that reads them."""
        return segment_mask(self.segments), segment_positions(self.segments)

    def logits(self, model: nn.Module, rows: Tensor) -> Tensor:
        """`model`'s logits of the packed `rows` `(R, L)`: `(P, T, V)`, each sequence alone."""
        mask, positions = self.attention
        return model(self.pack(rows), mask=mask, input_pos=positions)[0]


def row_ends(completion_mask: Tensor) -> Tensor:
    """`(R, L)` bool -> `(R,)`: one past each row's last True (a row ends at its last
    completion token)."""
    return completion_mask.shape[1] - completion_mask.flip(1).int().argmax(dim=1)


def packing_for(model: nn.Module, completion_mask: Tensor) -> Packing | None:
    """How rows that end at their last completion token (`completion_mask` `(R, L)`: DPO's
    pairs, GRPO's completions) pack into rows of the model's context, or None where that does
    not pay (`Packing.plan`). A row's inputs run up to its last completion token, which is
    only a target."""
    L = completion_mask.shape[1]
    ends = row_ends(completion_mask)
    context = int(getattr(model, "module", model).context_length)  # under DDP's wrapper too
    return Packing.plan((ends - 1).tolist(), L - 1, context, completion_mask.device)
