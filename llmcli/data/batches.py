"""Training batches: random `(x, y)` windows of a token stream, as nanoGPT's `get_batch`.

`BatchSampler` draws each window's start uniformly over the stream with its own
`torch.Generator` (rank r of a DDP job draws its own stream), reads the windows from the token
file (`llmcli.data.windows.WindowReader`, which keeps memory flat however large the corpus), and
puts them on the device. Saving `state_dict()` and loading it into a new sampler continues the
exact stream: what a resumed run needs to see the batches an uninterrupted one would.
Conversations (`data.format: chat`) have samplers of their own, `llmcli.data.chat_batches`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from llmcli.data.windows import WindowReader
from llmcli.errors import InputError


def to_device(*tensors: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A batch's tensors on `device` (on CUDA, copied from pinned memory without waiting)."""
    if device.type == "cuda":
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)
    return tuple(t.to(device) for t in tensors)


def stream_seed(seed: int, rank: int) -> int:
    """Rank 0 draws from `seed` itself; other ranks from well-mixed, distinct seeds."""
    if rank == 0:
        return seed
    return int(np.random.SeedSequence([seed % (1 << 63), rank]).generate_state(1, np.uint64)[0])


def rank_generator(batch_size: int, seed: int, rank: int, world_size: int) -> torch.Generator:
    """A sampler's own generator, seeded for its rank (`stream_seed`), after checking the
    batch size and the rank that every sampler takes.

    Raises:
        ValueError: `batch_size` below 1, or `rank` outside `[0, world_size)`.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size ({batch_size}) must be positive")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank ({rank}) must be in [0, world_size={world_size})")
    return torch.Generator().manual_seed(stream_seed(seed, rank))


class BatchSampler:
    """Random `(x, y)` windows of a token stream, drawn with the sampler's own generator.

    Args:
        tokens: `(N,)` token ids, an `np.ndarray` or `np.memmap` (uint16/uint32).
        batch_size: B.
        context_length: T.
        seed: the stream's seed.
        rank: this process's rank under DDP.
        world_size: number of ranks.
        device: where `next()` puts the batches.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        context_length: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
    ) -> None:
        if len(tokens) < context_length + 1:
            raise InputError(
                f"the token stream has {len(tokens)} tokens, but context_length "
                f"({context_length}) needs at least {context_length + 1}."
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.context_length = context_length
        self.device = torch.device(device)
        self.generator = rank_generator(batch_size, seed, rank, world_size)
        self.batches = 0
        self.tokens_drawn = 0  # input positions handed out, padding left out (the log's tokens)
        self.reader = WindowReader(tokens, context_length + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch: `x` `(B, T)` int64 and `y` `(B, T)` int64, `y[:, t] == x[:, t+1]`."""
        T = self.context_length
        starts = torch.randint(len(self.tokens) - T, (self.batch_size,), generator=self.generator)
        windows = torch.from_numpy(self.reader.read(starts.numpy()))  # (B, T+1)
        x = windows[:, :-1].contiguous()  # (B, T)
        y = windows[:, 1:].contiguous()  # (B, T)
        self.batches += 1
        self.tokens_drawn += x.numel()
        return to_device(x, y, device=self.device)

    __next__ = next

    def __iter__(self) -> BatchSampler:
        return self

    def close(self) -> None:
        """Close the token file (also done when the sampler is garbage-collected)."""
        self.reader.close()

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        """Generator state and batch count; safe for `torch.load(weights_only=True)`."""
        return {"rng_state": self.generator.get_state(), "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream saved by `state_dict()`."""
        rng = state.get("rng_state")
        if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8:
            raise InputError("the data sampler state has no valid 'rng_state' (a uint8 tensor).")
        self.generator.set_state(rng.cpu())
        self.batches = int(state.get("batches", 0))
