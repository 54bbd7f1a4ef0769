"""A preference pair's scores: each reply's summed log-probability under a model, and DPO's
sigmoid loss over them with TRL's metrics (`DPOTrainer`, `loss_type="sigmoid"`,
`trl/trainer/dpo_trainer.py`).

A reply's score is the log-probability of its completion tokens, summed (not averaged: a longer
reply weighs more, as in TRL). DPO (Rafailov et al. 2023) measures each reply's score against a
frozen reference model's:

    loss = -logsigmoid(beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)))

Training minimises it (`llmcli.training.dpo`); `llmcli eval` reports it on a file of pairs
(`llmcli.evaluation.preferences`). Both read batches of `(2B, T+1)` rows, the chosen sequences
then the rejected ones (`llmcli.data.preference_data.pair_batch`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def sequence_logps(logits: Tensor, ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Each row's summed log-probability of its completion tokens.

    The logits at position t predict the token at t + 1, so a row's first token is never
    scored: a completion token needs at least one token before it.

    Args:
        logits: `(B, T, V)`, the model's output on `ids`.
        ids: `(B, T)` int64, the prompt then the completion (then any padding).
        completion_mask: `(B, T)` bool, True on the completion's tokens (never on padding).

    Returns:
        `(B,)` float32.
    """
    return target_logps(logits[:, :-1], ids[:, 1:], completion_mask[:, 1:])


def target_logps(logits: Tensor, targets: Tensor, target_mask: Tensor) -> Tensor:
    """Each row's summed log-probability of the targets `target_mask` marks, where
    `logits[:, t]` scores `targets[:, t]` (`sequence_logps` with the shift already made).

    Args:
        logits: `(B, T, V)`.
        targets: `(B, T)` int64.
        target_mask: `(B, T)` bool.

    Returns:
        `(B,)` float32.
    """
    B, T, V = logits.shape
    # cross_entropy is log_softmax and gather in one, without a (B, T, V) log-probability copy;
    # float32 so that a bf16 run's sums over long replies keep their precision.
    token_logps = -F.cross_entropy(
        logits.reshape(-1, V).float(), targets.reshape(-1), reduction="none"
    ).view(B, T)  # (B, T): the log-probability of each target
    return torch.where(target_mask, token_logps, 0.0).sum(dim=1)


def completion_logps(model: nn.Module, ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Each row's summed completion log-probability under `model`, which reads the first `T`
    tokens of rows of `T + 1` (its logits score the next ones, as a chat batch is scored).

    Args:
        model: `model(idx) -> (logits, loss)`.
        ids: `(R, T+1)` int64, prompts then completions, padded after their ends.
        completion_mask: `(R, T+1)` bool, True on the completions' tokens.

    Returns:
        `(R,)` float32 (with gradients, unless the caller turned them off).
    """
    logits, _ = model(ids[:, :-1])  # (R, T, V)
    return target_logps(logits, ids[:, 1:], completion_mask[:, 1:])


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The mean sigmoid DPO loss over a batch of pairs, and TRL's metrics of it.

    Args:
        policy_chosen, policy_rejected: `(B,)`, the policy's `sequence_logps` of each reply.
        ref_chosen, ref_rejected: `(B,)`, the reference's (no gradient flows into them).
        beta: how far the policy may move from the reference (TRL's `beta`, 0.1 by default).

    Returns:
        The loss (a scalar) and, under TRL's names, detached batch means: `rewards/chosen` and
        `rewards/rejected` (`beta * (policy - ref)`), `rewards/accuracies` (the share of pairs
        whose chosen reward is strictly higher), `rewards/margins` (chosen minus rejected),
        `logps/chosen` and `logps/rejected` (the policy's).
    """
    # The reference is frozen: its scores are constants of the loss, whatever computed them.
    chosen_logratios = policy_chosen - ref_chosen.detach()
    rejected_logratios = policy_rejected - ref_rejected.detach()
    loss = -F.logsigmoid(beta * (chosen_logratios - rejected_logratios)).mean()

    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": policy_chosen.detach().mean(),
        "logps/rejected": policy_rejected.detach().mean(),
    }
    return loss, metrics
