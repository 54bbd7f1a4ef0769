"""The training loop's loss estimate, and perplexity.

`evaluate_loss` is the estimate training logs at each evaluation: the mean loss over `eval_steps`
random batches of each split (averaged over ranks under DDP). `llmcli eval`'s deterministic pass
over a whole text is `llmcli.inspection.evaluate`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmcli.training.distributed import DistInfo, mean_over_ranks
from llmcli.training.precision import Precision


def perplexity(loss: float) -> float:
    """`exp(loss)`, infinite where that overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    samplers: dict[str, Any],
    eval_steps: int,
    precision: Precision,
    info: DistInfo,
) -> dict[str, float]:
    """The training loop's estimate: mean loss over `eval_steps` batches of each sampler.

    Args:
        model: the model to evaluate (put in eval mode here, back to train mode after).
        samplers: split name -> a fresh sampler whose `next()` gives `(x, y)`, each `(B, T)`.
        eval_steps: batches per split.
        precision: the autocast the training steps use.
        info: under DDP the means are averaged over the ranks.

    Returns:
        split name -> mean loss.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(len(samplers), device=precision.device)
    for i, sampler in enumerate(samplers.values()):
        for _ in range(eval_steps):
            x, y = sampler.next()  # (B, T), (B, T)
            with precision.autocast():
                _, loss = model(x, y)
            totals[i] += loss.float()
    totals /= eval_steps
    mean_over_ranks(totals, info)
    model.train(was_training)
    return dict(zip(samplers, totals.tolist(), strict=True))
