"""DPO's losses (`train.loss_type`), each TRL 1.16's formula (`DPOTrainer._compute_loss`,
`trl/trainer/dpo_trainer.py`), and TRL's metrics of a batch of pairs.

Every loss reads the policy's and the reference's summed completion log-probabilities of each
reply (`llmcli.objectives.preference_scores`). With `beta` (`train.dpo_beta`) and the log-ratios
`c = policy_chosen - ref_chosen`, `r = policy_rejected - ref_rejected` and `d = c - r`, each
loss is a mean over the pairs of (`eps` is `train.label_smoothing`, `s` logsigmoid):

    sigmoid       -s(beta d)                                  DPO (Rafailov et al. 2023)
    hinge         relu(1 - beta d)                            SLiC
    ipo           (c / n_c - r / n_r - 1 / (2 beta))^2        IPO, the ratios per token (n: tokens)
    exo_pair      sigmoid(beta d) (s(beta d) - log(1 - eps))
                  + sigmoid(-beta d) (s(-beta d) - log eps)   EXO
    nca_pair      -s(beta c) - s(-beta c) / 2 - s(-beta r) / 2
    robust        (-(1 - eps) s(beta d) + eps s(-beta d)) / (1 - 2 eps)
    bco_pair      -s(beta c) - s(-beta r)
    sppo_hard     (c - 1 / (2 beta))^2 + (r + 1 / (2 beta))^2
    aot           -(1 - eps) s(beta D) - eps s(-beta D), D the batch's sorted policy margins
                  less its sorted reference margins (aot_unpaired: sorted c less sorted r)
    apo_zero      1 - sigmoid(beta c) + sigmoid(beta r)
    apo_down      sigmoid(beta c) + 1 - sigmoid(beta d)
    sft           -policy_chosen summed over the batch / its chosen tokens (not a pair's mean)
    sigmoid_norm  -s(beta (c / n_c - r / n_r))

A list of types is the sum of their losses, each times its weight (`train.loss_weights`, 1.0
each by default): RPO is `[sigmoid, sft]`. TRL's `discopop` (it needs a `discopop_tau`), its
f-divergences other than the reverse KL, `ld_alpha` and WPO weighting are not here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from llmcli.config import TrainConfig
from llmcli.objectives.preference_scores import CompletionScores

logsig = F.logsigmoid


@dataclass(frozen=True)
class DPOLoss:
    """DPO's loss settings: `beta`, the loss types summed (TRL's names), one weight each, and
    the label smoothing the robust, exo_pair and aot losses read."""

    beta: float = 0.1
    types: tuple[str, ...] = ("sigmoid",)
    weights: tuple[float, ...] | None = None
    label_smoothing: float = 0.0

    @classmethod
    def from_config(cls, train: TrainConfig) -> DPOLoss:
        """The loss of a validated `train:` section (a null `loss_type`: sigmoid alone). A run
        trained with another objective, scored against a `--reference`, gets DPO's default
        loss: its `loss_type` is another objective's."""
        if train.objective != "dpo":
            return cls(beta=train.dpo_beta)
        weights = train.loss_weight_values
        return cls(
            beta=train.dpo_beta,
            types=tuple(train.resolved_loss_types),
            weights=None if weights is None else tuple(weights),
            label_smoothing=train.label_smoothing,
        )


def dpo_loss(
    chosen: CompletionScores,
    rejected: CompletionScores,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    loss: DPOLoss,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The weighted sum of `loss.types`' losses over a batch of pairs, and TRL's metrics.

    Args:
        chosen, rejected: the policy's scores of each reply, `(B,)` each.
        ref_chosen, ref_rejected: `(B,)`, the reference's summed log-probabilities (no
            gradient flows into them).
        loss: the settings (`DPOLoss.from_config`).

    Returns:
        The loss (a scalar) and, under TRL's names, detached batch means: `rewards/chosen` and
        `rewards/rejected` (`beta * (policy - ref)`), `rewards/accuracies` (the share of pairs
        whose chosen reward is strictly higher), `rewards/margins` (chosen minus rejected),
        `logps/chosen` and `logps/rejected` (the policy's), `logits/chosen` and
        `logits/rejected` (the mean logit over the vocabulary at each completion token,
        averaged over the batch's tokens).
    """
    weights = loss.weights or (1.0,) * len(loss.types)
    total = sum(
        weight * pair_losses(name, chosen, rejected, ref_chosen, ref_rejected, loss).mean()
        for name, weight in zip(loss.types, weights, strict=True)
    )
    assert isinstance(total, Tensor)
    chosen_rewards = loss.beta * (chosen.logps - ref_chosen).detach()
    rejected_rewards = loss.beta * (rejected.logps - ref_rejected).detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen.logps.detach().mean(),
        "logps/rejected": rejected.logps.detach().mean(),
        "logits/chosen": mean_logit(chosen),
        "logits/rejected": mean_logit(rejected),
    }
    return total, metrics


def mean_logit(scores: CompletionScores) -> Tensor:
    """TRL's `logits/*`: the mean logit over the vocabulary, averaged over all the rows'
    completion tokens (0 with none)."""
    tokens = scores.tokens.sum()
    return torch.where(tokens > 0, scores.logits.sum() / tokens.clamp(min=1), 0.0)


def pair_losses(
    name: str,
    chosen: CompletionScores,
    rejected: CompletionScores,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    loss: DPOLoss,
) -> Tensor:
    """One loss type's loss of each pair, `(B,)`: TRL's formula for `name` (the module doc)."""
    # The reference is frozen: its scores are constants of the loss, whatever computed them.
    pair = Pair(chosen, rejected, ref_chosen.detach(), ref_rejected.detach(), loss)
    return LOSSES[name](pair)


@dataclass
class Pair:
    """A batch of pairs as the formulas read them."""

    chosen: CompletionScores
    rejected: CompletionScores
    ref_chosen: Tensor
    ref_rejected: Tensor
    loss: DPOLoss

    @property
    def beta(self) -> float:
        return self.loss.beta

    @property
    def eps(self) -> float:
        return self.loss.label_smoothing

    @property
    def c(self) -> Tensor:
        """`(B,)`: TRL's `chosen_logratios` (and, under the reverse KL, `chosen_scores`)."""
        return self.chosen.logps - self.ref_chosen

    @property
    def r(self) -> Tensor:
        """`(B,)`: TRL's `rejected_logratios`."""
        return self.rejected.logps - self.ref_rejected

    @property
    def d(self) -> Tensor:
        """`(B,)`: TRL's `delta_score`."""
        return self.c - self.r

    @property
    def per_token(self) -> Tensor:
        """`(B,)`: the margin of the log-ratios each divided by its completion's length, as TRL
        computes it for ipo and sigmoid_norm (the IPO authors' form), so that beta means the
        same whatever the replies' lengths."""
        return self.c / self.chosen.tokens.clamp(min=1) - self.r / self.rejected.tokens.clamp(min=1)


def _exo_pair(p: Pair) -> Tensor:
    # The KL from the labels' distribution (1 - eps, eps) to the policy's softmax of the pair.
    won, lost = torch.sigmoid(p.beta * p.d), torch.sigmoid(-p.beta * p.d)
    return won * (logsig(p.beta * p.d) - math.log1p(-p.eps)) + lost * (
        logsig(-p.beta * p.d) - math.log(p.eps)
    )


def _aot(p: Pair) -> Tensor:
    # The policy's margins against the reference's, each sorted over the batch.
    delta = (p.chosen.logps - p.rejected.logps).sort().values
    delta = delta - (p.ref_chosen - p.ref_rejected).sort().values
    return -logsig(p.beta * delta) * (1 - p.eps) - logsig(-p.beta * delta) * p.eps


def _aot_unpaired(p: Pair) -> Tensor:
    delta = p.c.sort().values - p.r.sort().values
    return -logsig(p.beta * delta) * (1 - p.eps) - logsig(-p.beta * delta) * p.eps


def _sft(p: Pair) -> Tensor:
    # The chosen replies' negative log-likelihood per token over the whole batch (TRL's mean
    # over the batch's chosen tokens), the same for every pair.
    nll = -p.chosen.logps.sum() / p.chosen.tokens.sum().clamp(min=1)
    return nll.expand(p.c.shape)


# Each loss type's loss of each pair, in TRL's order (`DPOTrainer._compute_loss`).
LOSSES: dict[str, Callable[[Pair], Tensor]] = {
    "sigmoid": lambda p: -logsig(p.beta * p.d),
    "hinge": lambda p: torch.relu(1 - p.beta * p.d),
    "ipo": lambda p: (p.per_token - 1 / (2 * p.beta)) ** 2,
    "exo_pair": _exo_pair,
    "nca_pair": lambda p: (
        -logsig(p.beta * p.c) - 0.5 * logsig(-p.beta * p.c) - 0.5 * logsig(-p.beta * p.r)
    ),
    "robust": lambda p: (
        (-(1 - p.eps) * logsig(p.beta * p.d) + p.eps * logsig(-p.beta * p.d)) / (1 - 2 * p.eps)
    ),
    "bco_pair": lambda p: -logsig(p.beta * p.c) - logsig(-p.beta * p.r),
    "sppo_hard": lambda p: (p.c - 0.5 / p.beta) ** 2 + (p.r + 0.5 / p.beta) ** 2,
    "aot": _aot,
    "aot_unpaired": _aot_unpaired,
    "apo_zero": lambda p: 1 - torch.sigmoid(p.beta * p.c) + torch.sigmoid(p.beta * p.r),
    "apo_down": lambda p: torch.sigmoid(p.beta * p.c) + 1 - torch.sigmoid(p.beta * p.d),
    "sft": _sft,
    "sigmoid_norm": lambda p: -logsig(p.beta * p.per_token),
}
