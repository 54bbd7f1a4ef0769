"""What the samplers of rows share (conversations, preference pairs, GRPO's prompts): their own
seeded generator, drawing a batch's rows uniformly with replacement (`RowSampler.draw`), the
count of batches and of the positions handed out, and their state, saved and loaded as
`BatchSampler`'s, so that a resumed run draws what an uninterrupted one would."""

from __future__ import annotations

from typing import Any

import torch

from llmcli.data.batches import BatchSampler, rank_generator


class RowSampler:
    """A sampler of rows, drawn with its own generator (seeded for its rank); a subclass defines
    `next()`, which counts `batches` and `tokens_drawn`."""

    def __init__(self, batch_size: int, seed: int, rank: int, world_size: int) -> None:
        self.batch_size = batch_size
        self.generator = rank_generator(batch_size, seed, rank, world_size)
        self.batches = 0
        self.tokens_drawn = 0  # input positions handed out, padding left out (the log's tokens)

    def draw(self, n: int) -> list[int]:
        """The next batch's rows: `batch_size` indices below `n`, uniform, with replacement."""
        return torch.randint(n, (self.batch_size,), generator=self.generator).tolist()

    def __next__(self) -> Any:
        return self.next()  # each subclass draws its own kind of batch

    def __iter__(self) -> RowSampler:
        return self

    def close(self) -> None:
        """Nothing to close: the rows (in memory or memory-mapped) belong to the data."""

    state_dict = BatchSampler.state_dict
    load_state_dict = BatchSampler.load_state_dict
