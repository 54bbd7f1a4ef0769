"""The training loop's evaluation: its loss estimate and, with `train.head_metrics`, its heads.

`evaluate_loss` is the estimate training logs at each evaluation: the mean loss over `eval_steps`
random batches of each split (averaged over ranks under DDP), and, for `train.head_metrics`, the
loss at each position of the context, which `llmcli.evaluation.metrics.icl_score` turns into the
in-context learning score. Targets of -1 (conversations' tokens the model does not write,
`llmcli.data.chat_batches.ChatSampler`) are left out of both, as the model's loss leaves them out.
The batches come from their own samplers (`split_sampler`), seeded apart from the training
stream and made afresh at every evaluation: the same batches each time, and the training stream
is never touched. `llmcli eval`'s deterministic pass over a whole text is `llmcli.evaluation.run`.

Circuits during training: with `train.head_metrics`, each evaluation (`Evaluator`) also scores
every head on the fixed repeated-token probe (`llmcli.evaluation.probe`) on rank 0 and takes the
in-context learning score from the loss by position. Scoring touches no random number generator.
On conversations (`data.format: chat`) the heads are scored as on text, but there is no
in-context learning score: a window's positions follow the chat template's turns, and the loss
is on the assistant's tokens only, so its loss by position measures the template, not the use
of context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmcli.config import Config
from llmcli.data.chat_batches import IGNORE
from llmcli.data.prepared import TokenData
from llmcli.evaluation.metrics import icl_score
from llmcli.evaluation.probe import Probe, probe_scores
from llmcli.evaluation.text import token_losses
from llmcli.objectives import Objective, objective_for
from llmcli.training.distributed import DistInfo, mean_over_ranks
from llmcli.training.precision import Precision
from llmcli.training.step import LossFn, next_token_loss

# Evaluation batches come from their own samplers with this seed offset, re-created at every
# evaluation: the same batches each time, and the training stream is never touched.
EVAL_SEED_OFFSET = 1_000_003


@dataclass
class EvalLosses:
    """What `evaluate_loss` measured: each split's mean loss and, when asked, its mean loss at
    each position of the context (position t predicts token t + 1 from t + 1 tokens); with a
    `loss_fn` that gives metrics (DPO's), each split's mean of each, as `"val_rewards/margins"`."""

    mean: dict[str, float]
    by_position: dict[str, list[float]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    samplers: dict[str, Any],
    eval_steps: int,
    precision: Precision,
    info: DistInfo,
    *,
    by_position: bool = False,
    loss_fn: LossFn = next_token_loss,
) -> EvalLosses:
    """The training loop's estimate: mean loss over `eval_steps` batches of each sampler.

    Args:
        model: the model to evaluate (put in eval mode here, back to train mode after).
        samplers: split name -> a fresh sampler whose `next()` gives a batch: `(x, y)`, each
            `(B, T)`, unless `loss_fn` reads another kind.
        eval_steps: batches per split.
        precision: the autocast the training steps use.
        info: under DDP the means are averaged over the ranks.
        by_position: also measure each split's mean loss at each position of the context, from
            the same logits (for `icl_score`; next-token batches only).
        loss_fn: a batch's loss (the training step's; DPO's scores preference pairs).

    Returns:
        Each split's mean loss (and, with `by_position`, its loss by position; and the means of
        `loss_fn`'s metrics).
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(len(samplers), device=precision.device)
    positions: list[torch.Tensor] = []  # each split's summed loss at each position, (T,)
    metric_sums: dict[str, torch.Tensor] = {}  # "split_name" -> its sum over the batches
    for i, (split, sampler) in enumerate(samplers.items()):
        position_sum = torch.zeros((), device=precision.device)
        for _ in range(eval_steps):
            batch = sampler.next()
            with precision.autocast():
                if by_position:
                    x, y = batch  # (B, T), (B, T)
                    logits, loss = model(x, y)
                    extras = {}
                else:
                    loss, extras = loss_fn(model, batch)
            totals[i] += loss.float()
            for name, value in extras.items():
                key = f"{split}_{name}"
                metric_sums[key] = metric_sums.get(key, 0.0) + value.float()
            if by_position:
                token_loss = token_losses(logits, y)  # (B, T), 0 where ignored
                counted = (y != IGNORE).sum(0).clamp(min=1)  # (T,)
                position_sum = position_sum + token_loss.sum(0) / counted  # (B, T) -> (T,)
        positions.append(position_sum / eval_steps)
    totals /= eval_steps
    by_split = torch.stack(positions) if by_position else None  # (splits, T)
    mean_over_ranks(totals, info)
    metrics = _means(metric_sums, eval_steps, info)
    if by_split is not None:
        mean_over_ranks(by_split, info)
    model.train(was_training)
    mean = dict(zip(samplers, totals.tolist(), strict=True))
    if by_split is None:
        return EvalLosses(mean, metrics=metrics)
    return EvalLosses(mean, dict(zip(samplers, by_split.tolist(), strict=True)), metrics)


def _means(sums: dict[str, torch.Tensor], steps: int, info: DistInfo) -> dict[str, float]:
    """Each sum over `steps` batches as their mean (under DDP, over the ranks too)."""
    if not sums:
        return {}
    names = sorted(sums)
    means = torch.stack([sums[name] for name in names]) / steps
    mean_over_ranks(means, info)
    return dict(zip(names, means.tolist(), strict=True))


@dataclass
class Evaluation:
    """What one evaluation of the loop measured.

    Attributes:
        losses: each split's mean loss ("train", "val").
        summary: more figures for `metrics.jsonl`: with head metrics, the strongest heads'
            scores and the in-context learning score; with DPO, each split's rewards (e.g.
            `val_rewards/accuracies`); else empty.
        heads: with head metrics, the probe, every head's score grids and the loss by
            position (for `head_metrics.jsonl`); else None.
    """

    losses: dict[str, float]
    summary: dict[str, float] = field(default_factory=dict)
    heads: dict[str, Any] | None = None


class Evaluator:
    """The loop's evaluation: the loss estimate on fresh samplers over both splits, and on rank
    0 with `train.head_metrics` every head's scores on `probe`.

    Args:
        model: what evaluation runs: the model as steps run it (compiled with
            `train.compile`), without the DDP wrapper, whose forward would synchronise the
            ranks' buffers.
        unwrapped: the model itself, which the probe is scored on.
        data: the run's token data.
        precision: the autocast the training steps use.
        info: this process's place under torchrun.
        probe: what each head is scored on (rank 0 with `train.head_metrics`), else None.
        loss_fn: a batch's loss, the training step's (`llmcli.training.step.LossFn`).
        objective: the run's objective, whose `eval_loss` the estimate uses (None: the step's);
            each evaluation asks the config's objective what else it measures
            (`Objective.evaluate`, `by_position`).
    """

    def __init__(
        self,
        model: nn.Module,
        unwrapped: Any,
        data: TokenData,
        precision: Precision,
        info: DistInfo,
        probe: Probe | None,
        loss_fn: LossFn = next_token_loss,
        objective: Objective | None = None,
    ) -> None:
        self.model, self.unwrapped, self.data = model, unwrapped, data
        self.precision, self.info, self.probe = precision, info, probe
        self.step_loss = loss_fn
        self.loss_fn = loss_fn if objective is None else objective.eval_loss(loss_fn)

    def samplers(self, config: Config) -> dict[str, Any]:
        """Fresh samplers over both splits, seeded apart from the training stream."""
        seed, device = config.train.seed + EVAL_SEED_OFFSET, self.precision.device
        return {
            split: split_sampler(self.data, split, config, seed, self.info, device)
            for split in ("train", "val")
        }

    def __call__(self, config: Config) -> Evaluation:
        """Estimate both splits' losses (and score the heads) with `config`'s batch size and
        `train.eval_steps`."""
        tc = config.train
        objective = objective_for(config)  # the micro-batch as it is now
        own = objective.evaluate(self.step_loss, self.data, tc.eval_steps * tc.batch_size)
        if own is not None:  # GRPO's: greedy replies' reward and pass@1
            return Evaluation(*own)
        estimate = evaluate_loss(
            self.model,
            self.samplers(config),
            tc.eval_steps,
            self.precision,
            self.info,
            by_position=tc.head_metrics and objective.by_position,
            loss_fn=self.loss_fn,
        )
        if self.probe is None or not math.isfinite(estimate.mean["val"]):
            return Evaluation(estimate.mean, estimate.metrics)  # (a diverged run stops on val)
        scores = probe_scores(self.unwrapped, self.probe)  # touches no RNG
        by_position = estimate.by_position.get("val")
        icl = {}
        if by_position is not None:
            icl = {"val_loss_by_position": by_position, "icl_score": icl_score(by_position)}
        heads = {"probe": self.probe.describe(), **scores.grids(), **icl}
        icl.pop("val_loss_by_position", None)
        return Evaluation(estimate.mean, {**estimate.metrics, **scores.summary(), **icl}, heads)


def split_sampler(
    data: TokenData,
    split: str,
    config: Config,
    seed: int,
    info: DistInfo,
    device: torch.device,
    training: bool = False,
) -> Any:
    """The sampler of `data`'s split ("train" or "val"), as the run's objective draws it
    (`Objective.sampler`: the training stream's with `training`, else evaluation's); this
    rank's, seeded with `seed`."""
    objective = objective_for(config)
    return objective.sampler(data, split, seed, info.rank, info.world_size, device, training)
