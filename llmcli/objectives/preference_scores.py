"""A preference pair's scores: each reply's summed log-probability under a model, as TRL's
`DPOTrainer` computes them (`trl/trainer/dpo_trainer.py`).

A reply's score is the log-probability of its completion tokens, summed (not averaged: a longer
reply weighs more, as in TRL). DPO (Rafailov et al. 2023) measures each reply's score against a
frozen reference model's; its losses are `llmcli.objectives.dpo_losses`'. Training minimises
them (`llmcli.objectives.dpo`); `llmcli eval` reports them on a file of pairs
(`llmcli.evaluation.preferences`). Both read batches of `(2B, T+1)` rows, the chosen sequences
then the rejected ones (`llmcli.data.preference_data.pair_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmcli.data.preference_data import PreferenceSplit, pair_batch
from llmcli.objectives.packing import Packing, packing_for
from llmcli.progress import Progress


@dataclass
class CompletionScores:
    """Each row's completion scored by the policy, `(R,)` float32 each: what DPO's losses and
    TRL's `logps/*` and `logits/*` metrics read.

    Attributes:
        logps: the completion tokens' log-probabilities, summed (with gradients).
        tokens: how many completion tokens were scored (the sft and ipo losses average by them).
        logits: the mean over the vocabulary of the logits that scored each completion token,
            summed over them (detached; TRL's `logits/chosen` is their sum over the chosen
            rows over the chosen tokens).
    """

    logps: Tensor
    tokens: Tensor
    logits: Tensor

    def halves(self) -> tuple[CompletionScores, CompletionScores]:
        """The first and second halves of the rows: a pair batch's chosen and rejected."""
        halves = [getattr(self, f.name).chunk(2) for f in fields(self)]
        return CompletionScores(*(h[0] for h in halves)), CompletionScores(*(h[1] for h in halves))

    def to(self, device: torch.device | str) -> CompletionScores:
        """The scores on `device`."""
        return CompletionScores(*(getattr(self, f.name).to(device) for f in fields(self)))

    @staticmethod
    def cat(parts: list[CompletionScores]) -> CompletionScores:
        """The rows of `parts`, one after the other."""
        return CompletionScores(
            *(torch.cat([getattr(part, f.name) for part in parts]) for f in fields(parts[0]))
        )


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
    return torch.where(target_mask, each_target_logp(logits, targets), 0.0).sum(dim=1)


def each_target_logp(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """The log-probability of each target, `logits[:, t]` (divided by `temperature`) scoring
    `targets[:, t]`: `(B, T, V)`, `(B, T)` -> `(B, T)` float32."""
    B, T, V = logits.shape
    # cross_entropy is log_softmax and gather in one, without a (B, T, V) log-probability copy;
    # float32 so that a bf16 run's sums over long replies keep their precision.
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    return -F.cross_entropy(scaled.reshape(-1, V), targets.reshape(-1), reduction="none").view(B, T)


def target_scores(logits: Tensor, targets: Tensor, target_mask: Tensor) -> CompletionScores:
    """`target_logps`, with the count of the targets scored and the mean logits at them.

    Args:
        logits: `(B, T, V)`; `logits[:, t]` scores `targets[:, t]`.
        targets: `(B, T)` int64.
        target_mask: `(B, T)` bool.
    """
    with torch.no_grad():  # a metric: TRL's fused head computes it without gradient too
        mean_logits = logits.mean(dim=-1, dtype=torch.float32)  # (B, T): over the vocabulary
    return _summed(each_target_logp(logits, targets), mean_logits, target_mask)


def _summed(logps: Tensor, mean_logits: Tensor, target_mask: Tensor) -> CompletionScores:
    """Each row's sums over its scored targets: `(B, T)` each -> `CompletionScores`."""
    return CompletionScores(
        torch.where(target_mask, logps, 0.0).sum(dim=1),
        target_mask.sum(dim=1).float(),
        torch.where(target_mask, mean_logits, 0.0).sum(dim=1).detach(),
    )


def target_positions(
    model: nn.Module,
    ids: Tensor,
    packing: Packing | None = None,
    temperature: float = 1.0,
    means: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Each position's log-probability of the next token under `model`: `(R, L)` ids ->
    `(R, L - 1)` float32, position t scoring token t + 1 from the logits divided by
    `temperature`; with `means`, the mean over the vocabulary of the logits there too
    (detached), else None. With `packing` (`llmcli.objectives.packing.packing_for`) the rows
    are packed whole into rows of the context, and positions past a row's end are 0."""
    if packing is None:
        logits = model(ids[:, :-1])[0]  # (R, L - 1, V)
        logps = each_target_logp(logits, ids[:, 1:], temperature)
    else:
        logits = packing.logits(model, ids[:, :-1])  # (P, T, V)
        logps = packing.unpack(each_target_logp(logits, packing.pack(ids[:, 1:]), temperature))
    if not means:
        return logps, None
    with torch.no_grad():  # a metric: TRL's fused head computes it without gradient too
        mean_logits = logits.mean(dim=-1, dtype=torch.float32)
    return logps, mean_logits if packing is None else packing.unpack(mean_logits)


def completion_scores(
    model: nn.Module, ids: Tensor, completion_mask: Tensor, packing: Packing | None = None
) -> CompletionScores:
    """`completion_logps` with what the policy's side of DPO also reads (`target_scores`).

    Args:
        model: `model(idx) -> (logits, loss)`.
        ids: `(R, T+1)` int64, prompts then completions, padded after their ends.
        completion_mask: `(R, T+1)` bool, True on the completions' tokens.
        packing: the rows packed whole into rows of the context (`packing_for`); None: scored
            as they are.
    """
    logps, mean_logits = target_positions(model, ids, packing, means=True)
    assert mean_logits is not None
    return _summed(logps, mean_logits, completion_mask[:, 1:])


def completion_logps(
    model: nn.Module, ids: Tensor, completion_mask: Tensor, packing: Packing | None = None
) -> Tensor:
    """Each row's summed completion log-probability under `model`, which reads the first `T`
    tokens of rows of `T + 1` (its logits score the next ones, as a chat batch is scored).
    With `packing` the rows are packed whole into rows of the context, each attending only to
    itself (`llmcli.objectives.packing`): the same scores, less padding.

    Args:
        model: `model(idx) -> (logits, loss)`.
        ids: `(R, T+1)` int64, prompts then completions, padded after their ends.
        completion_mask: `(R, T+1)` bool, True on the completions' tokens.
        packing: the rows' packing (`packing_for`, planned once for every model that scores
            them); None: scored as they are.

    Returns:
        `(R,)` float32 (with gradients, unless the caller turned them off).
    """
    logps, _ = target_positions(model, ids, packing)
    return torch.where(completion_mask[:, 1:], logps, 0.0).sum(dim=1)


@dataclass
class PairLogps:
    """Each scored pair's replies, `(P,)` float32 each: the run's model's scores, and the
    reference's summed completion log-probabilities (None without one)."""

    chosen: CompletionScores
    rejected: CompletionScores
    ref_chosen: Tensor | None = None
    ref_rejected: Tensor | None = None


@torch.no_grad()
def score_pairs(
    model: nn.Module,
    reference: nn.Module | None,
    split: PreferenceSplit,
    pad_id: int,
    batch_size: int,
    *,
    count: int | None = None,
    progress: bool = False,
) -> PairLogps:
    """The first `count` pairs of `split` (None: all) scored in order, `batch_size` at a time,
    each batch padded to its longest sequence (`pair_batch`), as training's batches are:
    attention is causal, so the padding after a sequence changes none of its logits, and it is
    never in the mask."""
    device = next(model.parameters()).device
    count = len(split) if count is None else min(count, len(split))
    starts = range(0, count, batch_size)
    bar = Progress(len(starts), desc="eval", unit="batch", enabled=progress, tenths=True)
    policy: list[tuple[CompletionScores, CompletionScores]] = []
    ref: list[tuple[Tensor, Tensor]] = []
    for lo in starts:
        picks = range(lo, min(lo + batch_size, count))
        ids, mask = pair_batch(split, picks, pad_id)  # (2B, L)
        ids, mask = ids.to(device), mask.to(device)
        packing = packing_for(model, mask)
        scores = completion_scores(model, ids, mask, packing)  # (2B,) each
        policy.append(scores.to("cpu").halves())
        if reference is not None:
            ref.append(completion_logps(reference, ids, mask, packing).cpu().chunk(2))  # (B,) each
        bar.update()
    bar.close()
    chosen, rejected = (CompletionScores.cat([pair[k] for pair in policy]) for k in (0, 1))
    if reference is None:
        return PairLogps(chosen, rejected)
    return PairLogps(chosen, rejected, *(torch.cat([pair[k] for pair in ref]) for k in (0, 1)))
