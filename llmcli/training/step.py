"""One optimizer step, on one screen: micro-batches, autocast, forward, backward, clip, step.

`train_step` is what nanoGPT's train.py does between two log lines (`for micro_step in
range(gradient_accumulation_steps)` ... `optimizer.zero_grad(set_to_none=True)`), as a function
of what it works with (`Trainer`). What keeps a run safe sits around it, in the loop
(`llmcli.training.loop`), not inside: the spike guard (`llmcli.training.guard`) and the layer
watch (`llmcli.training.layers`) see the gradients as the step's `before_update`; the
out-of-memory retry, logging, evaluation, saving and stopping are the loop's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from llmcli.config import TrainConfig
from llmcli.objectives.base import next_token_loss
from llmcli.training.optim import build_optimizer
from llmcli.training.precision import Precision

#: Called after backward with the step's loss and gradient norm (0-d tensors on the device),
#: before the weights change; False refuses the update (the spike guard).
BeforeUpdate = Callable[[Tensor, Tensor], bool]

#: A micro-batch's loss and its metrics (0-d tensors by name, e.g. DPO's rewards; {} for none):
#: `loss_fn(model, batch)`, where `batch` is what the training stream's `next()` gives.
LossFn = Callable[[nn.Module, Any], tuple[Tensor, dict[str, Tensor]]]


@dataclass
class Trainer:
    """What a training step works with (built by `llmcli.training.build.build_run`).

    Attributes:
        model: the module a step runs: the model, compiled with `train.compile`, wrapped in
            `DistributedDataParallel` under torchrun.
        params: the model's parameters, clipped together.
        optimizer: updates them (`llmcli.training.optim`).
        precision: the autocast context and the GradScaler (which does nothing unless fp16).
        batches: the training stream; `next()` gives a batch on the device: `(x, y)`, each
            `(B, T)`, for next-token training; `(ids, completion_mask)` for DPO. Its
            `tokens_drawn` counts the positions its batches hold, padding left out (the
            loop's tokens and tokens per second).
        grad_accum: micro-batches per step.
        grad_clip: the largest global gradient norm (0: no clipping).
        loss_fn: a micro-batch's loss (`train.objective`: `next_token_loss`, or DPO's,
            `llmcli.objectives.dpo.dpo_objective`).
    """

    model: nn.Module
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    precision: Precision
    batches: Any
    grad_accum: int
    grad_clip: float
    loss_fn: LossFn = next_token_loss


def make_trainer(
    model: nn.Module,
    train: TrainConfig,
    precision: Precision,
    batches: Any,
    no_decay: Collection[str] = (),
    step_model: nn.Module | None = None,
) -> Trainer:
    """The one place a `Trainer` is built (the run's, `llmcli plan`'s timing, `llmcli bench`'s):
    `train.optimizer` over what trains (a LoRA run's adapters; `no_decay`: matrices kept from
    weight decay), `train.grad_accum` and `train.grad_clip`. `step_model` is the module the
    steps run, if not `model` (compiled). The loss is next-token's until the objective wires
    its own (`llmcli.objectives.base.Objective.wire`)."""
    return Trainer(
        model=model if step_model is None else step_model,
        params=[p for p in model.parameters() if p.requires_grad],
        optimizer=build_optimizer(model, train, precision.device.type, no_decay),
        precision=precision,
        batches=batches,
        grad_accum=train.grad_accum,
        grad_clip=train.grad_clip,
    )


def train_step(
    trainer: Trainer, before_update: BeforeUpdate | None = None
) -> tuple[Tensor, Tensor, bool, dict[str, Tensor]]:
    """One optimizer step over `grad_accum` micro-batches of the training stream.

    Returns:
        `(loss, norm, applied, metrics)`: the micro-batches' mean loss and the global gradient
        norm before clipping, 0-d tensors left on the device (reading them would wait for it),
        whether the weights were updated (`before_update` may refuse), and the micro-batches'
        mean of each metric `loss_fn` gives (on the device too; {} for next-token training).
    """
    model, optimizer, scaler = trainer.model, trainer.optimizer, trainer.precision.scaler
    ddp = isinstance(model, DistributedDataParallel)
    loss_sum = torch.zeros((), device=trainer.precision.device)
    metrics: dict[str, Tensor] = {}
    for micro in range(trainer.grad_accum):
        batch = trainer.batches.next()  # next-token: (x, y), each (B, T)
        # Under DDP the gradients are averaged over the ranks once, in the last backward.
        last = micro == trainer.grad_accum - 1
        with nullcontext() if last or not ddp else model.no_sync():
            with trainer.precision.autocast():
                loss, extras = trainer.loss_fn(model, batch)
            loss = loss / trainer.grad_accum  # the micro-batches' mean, summed by backward
            scaler.scale(loss).backward()  # fp16: scaled, so that small gradients stay > 0
        loss_sum += loss.detach()
        for name, value in extras.items():
            metrics[name] = metrics.get(name, 0.0) + value.detach().float() / trainer.grad_accum
    scaler.unscale_(optimizer)  # the true gradients, to measure and clip
    grads = [p.grad for p in trainer.params if p.grad is not None]
    norm = nn.utils.get_total_norm(grads, foreach=True)
    applied = before_update is None or before_update(loss_sum, norm)
    if applied:
        if trainer.grad_clip > 0:
            nn.utils.clip_grads_with_norm_(trainer.params, trainer.grad_clip, norm, foreach=True)
        scaler.step(optimizer)  # fp16: skipped where a gradient overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, norm, applied, metrics


def all_of(*checks: BeforeUpdate | None) -> BeforeUpdate | None:
    """One `before_update` that runs `checks` in order (None: left out) and lets the update
    through only if each does; None when there are none."""
    present = [check for check in checks if check is not None]
    if not present:
        return None
    return lambda loss, norm: all(check(loss, norm) for check in present)
