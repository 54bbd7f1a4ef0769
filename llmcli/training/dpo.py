"""Direct Preference Optimization (Rafailov et al. 2023): the sigmoid loss on preference pairs,
as TRL's `DPOTrainer` computes it (`loss_type="sigmoid"`, `trl/trainer/dpo_trainer.py`).

A pair's score under a model is the log-probability of its completion tokens, summed (not
averaged: a longer reply weighs more, as in TRL). The policy learns to raise the chosen reply's
score over the rejected one's, each measured against a frozen reference model (the run it
started from):

    loss = -logsigmoid(beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)))

`dpo_step` scores one batch of `llmcli.data.preference_data.PreferenceSampler` under the policy
and the reference. With `train.objective: dpo` the run's step takes its loss from
`dpo_objective` (the trainer's `loss_fn`), and the reference is `reference_model`: the
`train.init_from` weights, frozen. The loop itself is the same as next-token training's.

A batch of B pairs is 2B rows, as `train.batch_size`, the memory estimate, `llmcli plan` and
the tokens a step counts take it (`Config.example_tokens`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmcli.config import Config
from llmcli.model.gpt import Transformer
from llmcli.training.init_from import load_init_weights


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


def dpo_step(
    policy: nn.Module, reference: nn.Module, ids: Tensor, completion_mask: Tensor, beta: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """The DPO loss of one batch of pairs, and its metrics (`dpo_loss`'s).

    The models read the first `T` tokens of each row and their logits score the next ones, as
    a chat batch is scored: rows of `T + 1` tokens fill a `T`-token context. The reference runs
    under `torch.no_grad`, so only the policy gets gradients (and no activations of the
    reference are kept).

    Args:
        policy: the model being trained, `model(idx) -> (logits, loss)`.
        reference: the frozen model it started as.
        ids: `(2B, T+1)` int64, the chosen sequences then the rejected ones (pair i is rows
            i and B + i), padded after their ends.
        completion_mask: `(2B, T+1)` bool, True on the completions' tokens.
        beta: DPO's beta (`train.dpo_beta`).
    """
    x, targets, mask = ids[:, :-1], ids[:, 1:], completion_mask[:, 1:]  # each (2B, T)
    B = ids.shape[0] // 2
    logps = target_logps(policy(x)[0], targets, mask)  # (2B,)
    with torch.no_grad():
        ref_logps = target_logps(reference(x)[0], targets, mask)  # (2B,)
    return dpo_loss(logps[:B], logps[B:], ref_logps[:B], ref_logps[B:], beta)


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


def reference_model(config: Config, vocab_size: int, device: torch.device) -> Transformer:
    """The frozen reference: `train.init_from`'s weights (as the policy starts from them, also
    when a run resumes), in eval mode (no dropout) and without gradients."""
    assert config.train.init_from, "DPO's reference is train.init_from's model"
    reference = Transformer(config.model, vocab_size)
    load_init_weights(reference, config.train.init_from)
    reference.to(device).eval()
    reference.requires_grad_(False)
    return reference


def dpo_batch_loss(
    reference: nn.Module, beta: float, policy: nn.Module, batch: tuple[Tensor, Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """`dpo_step` on a `PreferenceSampler` batch `(ids, completion_mask)`, each `(2B, T+1)`."""
    ids, completion_mask = batch
    return dpo_step(policy, reference, ids, completion_mask, beta)


def dpo_objective(reference: nn.Module, beta: float) -> partial:
    """The step's `loss_fn` for `train.objective: dpo`: `loss_fn(policy, batch)`."""
    return partial(dpo_batch_loss, reference, beta)
