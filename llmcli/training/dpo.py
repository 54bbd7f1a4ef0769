"""Direct Preference Optimization (Rafailov et al. 2023): the sigmoid loss on preference pairs,
as TRL's `DPOTrainer` computes it (`loss_type="sigmoid"`, `trl/trainer/dpo_trainer.py`).

A pair's score under a model is the log-probability of its completion tokens, summed (not
averaged: a longer reply weighs more, as in TRL). The policy learns to raise the chosen reply's
score over the rejected one's, each measured against a frozen reference model (the run it
started from):

    loss = -logsigmoid(beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)))

The pieces here are the maths only; the training objective that feeds them batches of pairs
(`train.objective: dpo`, `llmcli.data.preferences` for the data) is still to come.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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
    B, T, V = logits.shape
    # cross_entropy is log_softmax and gather in one, without a (B, T, V) log-probability copy;
    # float32 so that a bf16 run's sums over long replies keep their precision.
    token_logps = -F.cross_entropy(
        logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1), reduction="none"
    ).view(B, T - 1)  # (B, T-1): the log-probability of each next token
    return torch.where(completion_mask[:, 1:], token_logps, 0.0).sum(dim=1)


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
