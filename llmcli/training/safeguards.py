"""What keeps a step from harming a run, around `llmcli.training.step.train_step`.

- the out-of-memory retry (`fitting_step`): in a fresh run's first steps an automatic micro-batch
  that does not fit is made smaller and the step tried again;
- what looks at the gradients before the update (`UpdateCheck`): the layer watch
  (`train.log_layers`) and the spike guard (`llmcli.training.guard`), whose verdict is read from
  the device (`judge`) and acted on after the step (`refused`: log the skip, roll back, or stop);
- a loss that is not finite (`check_finite`), and the message of a run that diverged
  (`diverged`, `DivergenceError`).
"""

from __future__ import annotations

import logging
import math

import torch

from llmcli.errors import InputError
from llmcli.training.distributed import mean_over_ranks
from llmcli.training.guard import Verdict
from llmcli.training.layers import LayerWatch
from llmcli.training.readout import LossLog
from llmcli.training.run import Run
from llmcli.training.step import train_step

logger = logging.getLogger(__name__)


class DivergenceError(InputError):
    """The loss became NaN or infinite (too high a learning rate, usually)."""


def fitting_step(run: Run, check: UpdateCheck) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """`train_step` (its loss, norm and whether the update was applied); in a fresh run's first
    steps, an automatic micro-batch that runs out of memory is made smaller and the step tried
    again (`Run.shrink_micro_batch`)."""
    while True:
        try:
            loss, norm, applied = train_step(run.trainer, check)
            break
        except torch.OutOfMemoryError:
            if not run.can_shrink_batch():
                raise
        # Outside the handler: the failed step's tensors are free by now.
        run.shrink_micro_batch()
    if applied and check.watch is not None:
        check.watch.after_step()
    return loss, norm, applied


class UpdateCheck:
    """What looks at a step's gradients before the weights change: the layer watch
    (`train.log_layers`: each layer's gradient norm, and the weights before the update) and the
    spike guard, whose verdict on a step it refuses is kept for the loop (`verdict`)."""

    def __init__(self, run: Run, watch: LayerWatch | None) -> None:
        self.run, self.watch = run, watch
        self.verdict: Verdict | None = None

    def __call__(self, loss: torch.Tensor, norm: torch.Tensor) -> bool:
        if self.watch is not None:
            self.watch.read_grads()  # unscaled, before clipping
        if self.run.guard is not None:
            verdict = judge(self.run, loss, norm)
            if verdict.event is not None:
                self.verdict = verdict
                return False
        if self.watch is not None:
            self.watch.before_step()
        return True


def judge(run: Run, loss: torch.Tensor, norm: torch.Tensor) -> Verdict:
    """The spike guard's verdict on the step just computed (`llmcli.training.guard`), from its
    loss and gradient norm read from the device (the means over ranks: every rank decides
    alike); under fp16 the norm is the GradScaler's to judge."""
    assert run.guard is not None
    values = torch.stack([loss, norm]).float()
    mean_over_ranks(values, run.info)
    loss_value, norm_value = values.tolist()
    judged_norm = None if run.precision.scales_loss else norm_value
    return run.guard.check(run.state.step + 1, loss_value, judged_norm)


def refused(run: Run, verdict: Verdict | None, losses: LossLog) -> None:
    """After the spike guard refused a step: log the skip, roll the run back to its last save
    when the guard says so, or stop it (`DivergenceError`) when it cannot recover."""
    assert run.guard is not None and verdict is not None and verdict.event is not None
    step, loss = verdict.event["step"], verdict.event["loss"]
    log_event(
        run, verdict.event, f"step {step} skipped ({verdict.event['reason']}, loss {loss:.4g})"
    )
    can_roll_back = run.state.last_saved >= 0
    if verdict.action == "rollback" and can_roll_back:
        event = run.rollback(step, loss)
        losses.clear()  # the losses of the steps undone are not logged
        log_event(
            run,
            event,
            f"rolled back to step {event['to_step']} (rollback {event['rollback']}): learning "
            f"rate x {event['lr_factor']:g} until step {event['lr_until_step']}, on new batches",
        )
    elif verdict.action != "skip":
        raise diverged(run, step, loss, run.guard.stop_advice(verdict.event, can_roll_back))


def log_event(run: Run, record: dict, message: str) -> None:
    """Rank 0: a spike-guard event into metrics.jsonl (and the trackers), and a warning."""
    if run.log is not None:
        run.log.metrics.write(record)
        logger.warning("spike guard: %s", message)


def check_finite(run: Run, step_losses: list[float]) -> None:
    first = run.state.step - len(step_losses) + 1
    for offset, value in enumerate(step_losses):
        if not math.isfinite(value):
            raise diverged(run, first + offset, value)


def diverged(run: Run, step: int, value: float, what: str | None = None) -> DivergenceError:
    """The message of a diverged run: `what` happened (default: the loss became `value` at
    `step`), the last good checkpoint, and what to change."""
    lr, saved = run.config.train.lr, run.state.last_saved
    kept = (
        f"the last good checkpoint (step {saved}) in '{run.run_dir}' is intact"
        if saved >= 0
        else "no checkpoint was saved before it"
    )
    what = what or f"the loss became {value} at step {step}: training diverged"
    return DivergenceError(
        f"{what}, {kept}. Lower the learning rate (train.lr = {lr:g}; try --set "
        f"train.lr={lr / 3:.3g}), or raise train.warmup_steps or lower train.grad_clip"
        + (", and check the data around this step." if run.guard is not None else ".")
    )
