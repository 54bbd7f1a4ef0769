"""The training loop's loss estimate.

`evaluate_loss` is the estimate training logs at each evaluation: the mean loss over `eval_steps`
random batches of each split (averaged over ranks under DDP), and, for `train.head_metrics`, the
loss at each position of the context, which `llmcli.evaluation.metrics.icl_score` turns into the
in-context learning score. Targets of -1 (conversations' tokens the model does not write,
`llmcli.data.chat_batches.ChatSampler`) are left out of both, as the model's loss leaves them out.
`llmcli eval`'s deterministic pass over a whole text is `llmcli.evaluation.run`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmcli.training.distributed import DistInfo, mean_over_ranks
from llmcli.training.precision import Precision


@dataclass
class EvalLosses:
    """What `evaluate_loss` measured: each split's mean loss and, when asked, its mean loss at
    each position of the context (position t predicts token t + 1 from t + 1 tokens)."""

    mean: dict[str, float]
    by_position: dict[str, list[float]] = field(default_factory=dict)


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    samplers: dict[str, Any],
    eval_steps: int,
    precision: Precision,
    info: DistInfo,
    *,
    by_position: bool = False,
) -> EvalLosses:
    """The training loop's estimate: mean loss over `eval_steps` batches of each sampler.

    Args:
        model: the model to evaluate (put in eval mode here, back to train mode after).
        samplers: split name -> a fresh sampler whose `next()` gives `(x, y)`, each `(B, T)`.
        eval_steps: batches per split.
        precision: the autocast the training steps use.
        info: under DDP the means are averaged over the ranks.
        by_position: also measure each split's mean loss at each position of the context, from
            the same logits (for `icl_score`).

    Returns:
        Each split's mean loss (and, with `by_position`, its loss by position).
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(len(samplers), device=precision.device)
    positions: list[torch.Tensor] = []  # each split's summed loss at each position, (T,)
    for i, sampler in enumerate(samplers.values()):
        position_sum = torch.zeros((), device=precision.device)
        for _ in range(eval_steps):
            x, y = sampler.next()  # (B, T), (B, T)
            with precision.autocast():
                logits, loss = model(x, y)
            totals[i] += loss.float()
            if by_position:
                token_loss = F.cross_entropy(
                    logits.float().transpose(1, 2), y, reduction="none", ignore_index=-1
                )  # (B, T), 0 where ignored
                counted = (y >= 0).sum(0).clamp(min=1)  # (T,)
                position_sum = position_sum + token_loss.sum(0) / counted  # (B, T) -> (T,)
        positions.append(position_sum / eval_steps)
    totals /= eval_steps
    by_split = torch.stack(positions) if by_position else None  # (splits, T)
    mean_over_ranks(totals, info)
    if by_split is not None:
        mean_over_ranks(by_split, info)
    model.train(was_training)
    mean = dict(zip(samplers, totals.tolist(), strict=True))
    if by_split is None:
        return EvalLosses(mean)
    return EvalLosses(mean, dict(zip(samplers, by_split.tolist(), strict=True)))
