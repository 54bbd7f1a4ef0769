"""Training batches of conversations (`data.format: chat`): `BatchSampler`'s, one conversation
a row (`ChatSampler`) or several packed whole into each row (`PackedChatSampler`).

`ChatSampler`: each row is one conversation's window from its first token (`llmcli.data.chat`
cut the windows), drawn uniformly over the windows with the sampler's own generator; the inputs
after the conversation's end are padding, and every target the model does not write (the
user's turns, the template's role tokens, the padding) is -1, which the loss ignores.

`PackedChatSampler` (`data.packing`, the default for chat): the same windows, drawn the same
way into a pool, packed whole into the rows by best fit (`best_fit`) with a segment id for
each position, so that the loss function (`llmcli.objectives.chat`) lets each conversation
attend only to itself, its positions counted from 0: its loss and gradients are those of the
conversation alone in a row. On the chat example's conversations (~38 positions each in
64-position rows) about 59% of a padded row is real tokens and about 76% of a packed one.

Each saves and loads its state as `BatchSampler`'s (the packed one with its pool), so a resumed
run sees the batches an uninterrupted one would.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from llmcli.data.batches import to_device
from llmcli.data.prepared import ChatSplit
from llmcli.data.row_sampler import RowSampler
from llmcli.errors import InputError

IGNORE = -1  # a target the loss leaves out (the model's `ignore_index`)
PADDING = 0  # the segment id of a packed row's padding; its conversations are 1, 2, ...


def conversation_into(split: ChatSplit, k: int, x: np.ndarray, y: np.ndarray) -> int:
    """Write window `k` of `split` at the start of `x` and `y` (views of a row): its inputs
    `ids[:-1]` and its targets `ids[1:]`, -1 where the model does not write the token.
    Returns the positions it takes, its length - 1."""
    start, length = int(split.starts[k]), int(split.lengths[k])
    ids = np.asarray(split.tokens[start : start + length], dtype=np.int64)  # (L,)
    written = np.asarray(split.mask[start + 1 : start + length], dtype=bool)  # (L-1,)
    x[: length - 1] = ids[:-1]
    y[: length - 1] = np.where(written, ids[1:], IGNORE)
    return length - 1


class ChatSampler(RowSampler):
    """Random `(x, y)` conversation windows, drawn with the sampler's own generator.

    Args:
        split: the split's ids, mask and windows (`llmcli.data.chat.ChatSplit`).
        pad_id: the input id after a conversation's end (its targets are ignored).
        batch_size, context_length, seed, rank, world_size, device: as `BatchSampler`'s.
    """

    def __init__(
        self,
        split: ChatSplit,
        pad_id: int,
        batch_size: int,
        context_length: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
    ) -> None:
        if len(split.starts) == 0:
            raise InputError("the split has no conversation window to draw from.")
        super().__init__(batch_size, seed, rank, world_size)
        self.split, self.pad_id = split, pad_id
        self.context_length = context_length
        self.device = torch.device(device)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch: `x` `(B, T)` int64 and `y` `(B, T)` int64, where `y[:, t]` is
        `x[:, t+1]` on the tokens the model writes and -1 elsewhere."""
        T, split = self.context_length, self.split
        picks = self.draw(len(split.starts))
        x = np.full((self.batch_size, T), self.pad_id, dtype=np.int64)  # (B, T)
        y = np.full((self.batch_size, T), IGNORE, dtype=np.int64)  # (B, T)
        for row, k in enumerate(picks):
            self.tokens_drawn += conversation_into(split, k, x[row], y[row])
        self.batches += 1
        return to_device(torch.from_numpy(x), torch.from_numpy(y), device=self.device)


def best_fit(sizes: list[int], rows: int, room: int) -> tuple[list[list[int]], list[int]]:
    """Best-fit decreasing: items of `sizes` into `rows` bins of `room` each.

    The items are taken longest first (ties in their order in `sizes`), each into the row
    with the least room left that still holds it (ties: the first such row); one that no row
    holds is left over.

    Returns:
        `(placed, left)`: each row's items (indices into `sizes`, in the order placed) and
        the items left over, in their order in `sizes`.
    """
    placed: list[list[int]] = [[] for _ in range(rows)]
    free = [room] * rows
    left = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):  # stable: ties keep order
        fits = [r for r in range(rows) if free[r] >= sizes[i]]
        if not fits:
            left.append(i)
            continue
        r = min(fits, key=lambda r: free[r])  # the first of the tightest
        placed[r].append(i)
        free[r] -= sizes[i]
    return placed, sorted(left)


class PackedChatSampler(ChatSampler):
    """Conversation windows packed whole into rows: `(x, y, segments)`, drawn with the
    sampler's own generator.

    Each batch tops up a pool of `pool_size` drawn windows (uniformly, as `ChatSampler` draws
    them) and packs it into the `B` rows of `T` positions by best fit (`best_fit`); a window
    takes its length - 1 positions (`x = ids[:-1]`, `y = ids[1:]`), and those that fit no row
    stay in the pool for the next batch, so that every drawn conversation is trained on and
    long ones as often as short ones. A row's conversations lie one after another from its
    first position, then padding (targets -1).

    Takes `ChatSampler`'s arguments.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Twice the batch: a larger pool fills the chat example's rows no better (76% real
        # tokens with 2, 4 or 8 batches' worth) and keeps windows waiting longer.
        self.pool_size = 2 * self.batch_size
        self.pool: list[int] = []  # drawn windows not yet packed, in the order drawn

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next batch: `x`, `y` as `ChatSampler`'s and `segments`, each `(B, T)` int64:
        `segments[b, t]` is 1, 2, ... for the row's conversations in order, 0 (`PADDING`) on
        its padding."""
        B, T, split = self.batch_size, self.context_length, self.split
        drawn = torch.randint(
            len(split.starts), (self.pool_size - len(self.pool),), generator=self.generator
        )
        self.pool.extend(drawn.tolist())
        sizes = [int(split.lengths[k]) - 1 for k in self.pool]  # positions each takes
        placed, left = best_fit(sizes, B, T)
        x = np.full((B, T), self.pad_id, dtype=np.int64)  # (B, T)
        y = np.full((B, T), IGNORE, dtype=np.int64)  # (B, T)
        segments = np.full((B, T), PADDING, dtype=np.int64)  # (B, T)
        for row, items in enumerate(placed):
            at = 0
            for segment, i in enumerate(items, start=1):
                n = conversation_into(split, self.pool[i], x[row, at:], y[row, at:])
                segments[row, at : at + n] = segment
                at += n
            self.tokens_drawn += at
        self.pool = [self.pool[i] for i in left]
        self.batches += 1
        tensors = (torch.from_numpy(a) for a in (x, y, segments))
        return to_device(*tensors, device=self.device)

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        """Generator state, batch count and the pool's windows."""
        return {**super().state_dict(), "pool": torch.tensor(self.pool, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream saved by `state_dict()` (a state without a pool, saved by
        `ChatSampler`, starts from an empty one)."""
        super().load_state_dict(state)
        pool = state.get("pool")
        self.pool = [] if pool is None else [int(k) for k in pool.tolist()]
        if any(not 0 <= k < len(self.split.starts) for k in self.pool):
            raise InputError(
                "the data sampler state's pool names conversations this split does not have: "
                "the data changed since the run was saved."
            )
