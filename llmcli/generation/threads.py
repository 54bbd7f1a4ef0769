"""CPU threads for generation: how many a sample runs on, and applying a count for a while.

`threads_for` is the count a generation runs on (`llmcli serve`'s batches): 1 for a small model
whose steps are mostly one-token decode steps (`decode_bound`, `sampling_threads`), torch's own
count otherwise; `sample_threads` is `llmcli sample`'s and `llmcli chat`'s, `--threads` where
given. `torch_threads` (`llmcli.device`) applies a count while a block runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmcli.config import SampleConfig
from llmcli.device import torch_threads as torch_threads  # where it is, for generation's users

# Up to this many non-embedding parameters a one-token decode step ran faster on one thread than
# on two (2-core VM, torch 2.13: 4L/128 0.70 vs 0.92 ms, 4L/192 1.56 vs 1.76, 4L/256 2.43 vs
# 2.49; 6L/384, 10.7M, 7.56 vs 6.92): its operations are too small to share.
ONE_THREAD_DECODE_PARAMS = 4_000_000


def decode_bound(config: SampleConfig, context_length: int) -> bool:
    """Whether a generation's steps are mostly one-token decode steps: always under `shift`;
    under `exact` only while every new token fits in the context (past it, each step recomputes
    the whole window)."""
    return config.context_policy == "shift" or config.max_new_tokens < context_length


def sampling_threads(model: nn.Module, device: torch.device, decode_bound: bool) -> int | None:
    """The CPU thread count generation runs best on: 1 when its steps are mostly one-token
    decode steps (`decode_bound`) of a small model, else None (keep torch's own choice, which
    full-window forwards and larger models use well)."""
    if device.type != "cpu" or not decode_bound:
        return None
    n_params = model.num_parameters(non_embedding=True)  # type: ignore[operator]
    return 1 if n_params <= ONE_THREAD_DECODE_PARAMS else None


def sample_threads(model: Any, config: SampleConfig, threads: int | None) -> int | None:
    """The CPU threads to sample with: `threads` (`--threads`) where given, else `threads_for`."""
    if threads is not None:
        return threads
    return threads_for(model, next(model.parameters()).device, config)


def threads_for(model: Any, device: torch.device, config: SampleConfig) -> int | None:
    """CPU threads for a sample (`sampling_threads`): 1 for a small model whose steps are mostly
    decode steps (`decode_bound`), else torch's own count (None)."""
    return sampling_threads(model, device, decode_bound(config, model.context_length))
