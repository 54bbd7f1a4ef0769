"""GRPO's loss as TRL 1.16's `GRPOTrainer` computes it (`trl/trainer/grpo_trainer.py`,
`_compute_loss`), as functions of tensors: the group-relative advantages, each token's
log-probability at the sampling temperature, PPO's clipped surrogate per token, how
`train.loss_type` sums it, and the KL penalty's estimate. `llmcli.objectives.grpo` samples the
completions and calls these; tests/test_grpo_loss.py holds each against TRL's code written out.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmcli.objectives.packing import Packing
from llmcli.objectives.preference_scores import target_positions


def advantages(rewards: Tensor, group_size: int, scale: bool) -> Tensor:
    """Each reward less its group's mean (rows in groups of `group_size`), divided by the
    group's standard deviation (+ 1e-4, as TRL) when `scale`. `(R,)` -> `(R,)`."""
    groups = rewards.view(-1, group_size)  # (P, G)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (groups.std(dim=1, keepdim=True) + 1e-4)
    return centred.reshape(-1)


def token_logps(
    model: nn.Module, ids: Tensor, temperature: float = 1.0, packing: Packing | None = None
) -> Tensor:
    """Each token's log-probability under `model` given the tokens before it, from the logits
    divided by `temperature` (the distribution a completion sampled at that temperature was
    drawn from): `(R, L)` ids -> `(R, L - 1)` float32, position t scoring token t + 1
    (`target_positions`; with `packing`, the rows packed whole into rows of the context)."""
    return target_positions(model, ids, packing, temperature)[0]


def per_token_loss(
    logps: Tensor,
    advantage: Tensor,
    old_logps: Tensor | None = None,
    epsilon: float = 0.2,
    epsilon_high: float = 0.2,
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped surrogate per token, as TRL's GRPO computes it:
    `-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)`, `r = exp(logp - old_logp)`.

    With one update per sample (`old_logps` None) the sampling policy is the policy itself: `r`
    is 1 in value with the log-probability's gradient, and the clip never acts.

    Args:
        logps: `(R, L-1)` the policy's log-probability of each next token.
        advantage: `(R,)`.
        old_logps: `(R, L-1)` the sampling policy's (no gradient), or None.
        epsilon, epsilon_high: the clip's bounds below and above 1.

    Returns:
        The loss `(R, L-1)`, and where the clip acted below (`r < 1 - epsilon`, `A < 0`) and
        above (`r > 1 + epsilon_high`, `A > 0`), each `(R, L-1)` bool.
    """
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    A = advantage[:, None]
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * A, clipped * A)
    low = (ratio < 1 - epsilon) & (A < 0)
    high = (ratio > 1 + epsilon_high) & (A > 0)
    return loss, low, high


def aggregate(
    per_token: Tensor, mask: Tensor, loss_type: str, dapo_tokens: float, max_new_tokens: int
) -> Tensor:
    """A micro-batch's loss from its per-token losses, as TRL's `loss_type` sums them, for a
    training step that averages its micro-batches' losses (`llmcli.training.step`).

    Args:
        per_token: `(R, L-1)`.
        mask: `(R, L-1)` bool, True where the next token is a completion token.
        loss_type: dapo, bnpo, grpo or dr_grpo (the module's docstring).
        dapo_tokens: the step's completion tokens over every rank, divided by the ranks and by
            the step's micro-batches (the step averages its micro-batches, DDP its ranks: so
            the step's gradient is that of its tokens' sum over all of them).
        max_new_tokens: `dr_grpo`'s constant, the longest completion.
    """
    m = mask.float()
    total = (per_token * m).sum()
    if loss_type == "dapo":
        return total / max(dapo_tokens, 1e-9)
    if loss_type == "bnpo":
        return total / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return total / (per_token.shape[0] * max_new_tokens)
    return ((per_token * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)).mean()  # grpo


def kl_per_token(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """TRL's estimate of the KL divergence to the reference, per token: `exp(ref - logp) -
    (ref - logp) - 1` (>= 0, 0 where they agree)."""
    diff = ref_logps - logps
    return torch.exp(diff) - diff - 1


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    m = mask.float()
    return (values * m).sum() / m.sum().clamp(min=1.0)
