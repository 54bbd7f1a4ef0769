"""Training batches of conversations (`data.format: chat`): `BatchSampler`'s, one conversation
a row.

Each row is one conversation's window from its first token (`llmcli.data.chat` cut the windows),
drawn uniformly over the windows with the sampler's own generator; the inputs after the
conversation's end are padding, and every target the model does not write (the user's turns, the
template's role tokens, the padding) is -1, which the loss ignores. Its state is saved and loaded
as `BatchSampler`'s, so a resumed run sees the batches an uninterrupted one would.
"""

from __future__ import annotations

import numpy as np
import torch

from llmcli.data.batches import BatchSampler, rank_generator, to_device
from llmcli.data.prepared import ChatSplit
from llmcli.errors import InputError

IGNORE = -1  # a target the loss leaves out (the model's `ignore_index`)


class ChatSampler:
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
        self.split, self.pad_id = split, pad_id
        self.batch_size = batch_size
        self.context_length = context_length
        self.device = torch.device(device)
        self.generator = rank_generator(batch_size, seed, rank, world_size)
        self.batches = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch: `x` `(B, T)` int64 and `y` `(B, T)` int64, where `y[:, t]` is
        `x[:, t+1]` on the tokens the model writes and -1 elsewhere."""
        T, split = self.context_length, self.split
        picks = torch.randint(len(split.starts), (self.batch_size,), generator=self.generator)
        x = np.full((self.batch_size, T), self.pad_id, dtype=np.int64)  # (B, T)
        y = np.full((self.batch_size, T), IGNORE, dtype=np.int64)  # (B, T)
        for row, k in enumerate(picks.tolist()):
            start, length = int(split.starts[k]), int(split.lengths[k])
            ids = np.asarray(split.tokens[start : start + length], dtype=np.int64)  # (L,)
            written = np.asarray(split.mask[start + 1 : start + length], dtype=bool)  # (L-1,)
            x[row, : length - 1] = ids[:-1]
            y[row, : length - 1] = np.where(written, ids[1:], IGNORE)
        self.batches += 1
        return to_device(torch.from_numpy(x), torch.from_numpy(y), self.device)

    __next__ = next

    def __iter__(self) -> ChatSampler:
        return self

    def close(self) -> None:
        """Nothing to close: the split's memory maps belong to its data."""

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        """Generator state and batch count, as `BatchSampler.state_dict`."""
        return {"rng_state": self.generator.get_state(), "batches": self.batches}

    load_state_dict = BatchSampler.load_state_dict
