"""The loss-spike and NaN guard (`train.spike_guard`): a step that would harm a run is skipped;
and the message of a run that diverged (`DivergenceError`).

The guard is the training step's `before_update` (`llmcli.training.step.train_step`): after the
backward pass, before the optimizer step, it reads the step's loss (the mean over micro-batches
and ranks, the figure the loop logs) and the global gradient norm from the device as two
numbers, and decides (`SpikeGuard.check`):

- apply: the loss and the norm are finite and the loss is at most `spike_factor` x the median of
  the last `spike_window` applied steps' losses (the factor test waits until the window is full),
  or at most `spike_margin` nats above it: near zero loss (a fine-tune that has learnt its task)
  a batch's loss varies by multiples of a small median without anything going wrong;
- skip: otherwise. The gradients are dropped: the weights, the optimizer's moments and the
  schedule stay as they were, the step is tried again on the next batches, and
  `{"kind": "event", "event": "skipped", ...}` goes to `metrics.jsonl` and the trackers;
- rollback: the `spike_skips`-th skip within `spike_window` steps. The run goes back to its last
  save (`llmcli.training.checkpoint.Checkpointer.rollback`: the weights, optimizer and counters
  of `state.pt`, the loading path a resume uses), keeps its batch sampler and random streams
  where they are, so the batches that caused it are not seen again, and multiplies the
  learning rate by `spike_lr_factor` for `spike_lr_steps` steps; `{"event": "rollback", ...}`;
- stop: a rollback needed after `spike_rollbacks` rollbacks in a row (a rollback counts towards
  the limit until the run trains past its lowered-rate steps), or with no save to go back to.
  The loop raises `DivergenceError` with `stop_advice`.

A refused step's verdict stays in `SpikeGuard.verdict` for the loop to act on.

Under a GradScaler (fp16), non-finite gradients are the scaler's business (it skips the step and
lowers its scale), so the guard judges the loss alone there.

Exact resume. The guard's state (the loss window, the recent skips, the lowered-rate steps and
the counts) is saved with the resume state. What a rollback keeps (the sampler, the RNGs, the
counts) is a function of the save it goes back to and the steps replayed since, so a run killed
after a rollback and resumed ends with the same weights as one never stopped.

Cost: two numbers read from the device per step and a median of `spike_window` floats
(`benchmarks/spike_guard_cost.py`); with `train.grad_clip` 0 the norm is computed for the guard,
one more pass over the gradients.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from llmcli.config import TrainConfig
from llmcli.errors import InputError
from llmcli.training.counters import TrainState
from llmcli.training.distributed import DistInfo, mean_over_ranks

Action = Literal["apply", "skip", "rollback", "stop"]


@dataclass
class GuardState:
    """What the guard carries across steps, saves and rollbacks.

    Attributes:
        recent: the losses of the last applied steps, oldest first (at most `spike_window`).
        skipped: the steps skipped within the last `spike_window` steps (1-based numbers).
        lowered_until: the learning rate is lowered for 0-based steps below this.
        streak: rollbacks in a row (reset once a step past the lowered-rate steps is applied).
        skips: steps skipped in the whole run.
        rollbacks: rollbacks in the whole run.
    """

    recent: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    lowered_until: int = 0
    streak: int = 0
    skips: int = 0
    rollbacks: int = 0

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> GuardState:
        """The state `asdict` wrote (raises KeyError, TypeError or ValueError when malformed)."""
        return cls(
            recent=[float(x) for x in saved["recent"]],
            skipped=[int(x) for x in saved["skipped"]],
            lowered_until=int(saved["lowered_until"]),
            streak=int(saved["streak"]),
            skips=int(saved["skips"]),
            rollbacks=int(saved["rollbacks"]),
        )


@dataclass(frozen=True)
class Verdict:
    """What to do with a step, and the event record of a skip (None for an applied step)."""

    action: Action
    event: dict[str, Any] | None = None


class SpikeGuard:
    """Decides, step by step, whether a step is applied, skipped or rolled back (module doc).

    Args:
        train: the `train:` section (the `spike_*` settings).
        counters: the loop's counters: the step judged is `counters.step + 1`.
        info: under torchrun the loss and norm judged are the means over the ranks.
        judge_norm: False under fp16's GradScaler, which judges the gradients itself.
    """

    def __init__(
        self,
        train: TrainConfig,
        counters: TrainState,
        info: DistInfo | None = None,
        judge_norm: bool = True,
    ) -> None:
        self.counters, self.info, self.judge_norm = counters, info or DistInfo(), judge_norm
        self.verdict: Verdict | None = None  # the last step's, when it was refused
        self.factor = train.spike_factor
        self.margin = train.spike_margin
        self.window = train.spike_window
        self.max_skips = train.spike_skips
        self.lr_factor = train.spike_lr_factor
        self.lr_steps = train.spike_lr_steps
        self.max_rollbacks = train.spike_rollbacks
        self.state = GuardState()

    def __call__(self, loss: torch.Tensor, norm: torch.Tensor) -> bool:
        """`train_step`'s `before_update`: whether the step just computed (its loss and gradient
        norm, 0-d tensors on the device) may update the weights; a refused step's verdict is
        kept in `verdict`."""
        values = torch.stack([loss, norm]).float()
        mean_over_ranks(values, self.info)  # every rank decides alike
        loss_value, norm_value = values.tolist()
        verdict = self.check(
            self.counters.step + 1, loss_value, norm_value if self.judge_norm else None
        )
        self.verdict = verdict if verdict.event is not None else None
        return self.verdict is None

    def lr_scale(self, step: int) -> float:
        """The factor on the learning rate of 0-based step `step`."""
        return self.lr_factor if step < self.state.lowered_until else 1.0

    def check(self, step: int, loss: float, grad_norm: float | None) -> Verdict:
        """The verdict on step `step` (1-based), whose loss and gradient norm are given
        (`grad_norm` None: not judged)."""
        state = self.state
        median = statistics.median(state.recent) if len(state.recent) >= self.window else None
        reason = self._reason(loss, grad_norm, median)
        if reason is None:
            state.recent.append(loss)
            del state.recent[: -self.window]
            if state.streak and step > state.lowered_until:
                state.streak = 0  # trained past the lowered-rate steps: recovered
            return Verdict("apply")
        state.skips += 1
        state.skipped = [s for s in state.skipped if s > step - self.window] + [step]
        event = {
            "kind": "event",
            "event": "skipped",
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "median": median,
            "reason": reason,
        }
        if len(state.skipped) < self.max_skips:
            return Verdict("skip", event)
        return Verdict("rollback" if state.streak < self.max_rollbacks else "stop", event)

    def _reason(self, loss: float, grad_norm: float | None, median: float | None) -> str | None:
        """Why a step must not be applied, or None."""
        if not math.isfinite(loss):
            return "loss not finite"
        if grad_norm is not None and not math.isfinite(grad_norm):
            return "gradient not finite"
        if median is not None and loss > max(self.factor * median, median + self.margin):
            return f"loss above {self.factor:g} x the median"
        return None

    def rolled_back(
        self, step: int, to_step: int, loss: float, saved: dict[str, Any] | None
    ) -> dict[str, Any]:
        """After a rollback at `step` to the save of `to_step`: take that save's loss window
        (`saved`: its guard state, None for none), keep the counts, lower the rate for the next
        `spike_lr_steps` steps; returns the rollback's event record."""
        now = self.state
        self.state = GuardState(
            recent=GuardState.from_dict(saved).recent if saved is not None else [],
            lowered_until=to_step + self.lr_steps,
            streak=now.streak + 1,
            skips=now.skips,
            rollbacks=now.rollbacks + 1,
        )
        return {
            "kind": "event",
            "event": "rollback",
            "step": step,
            "loss": loss,
            "to_step": to_step,
            "rollback": self.state.rollbacks,
            "lr_factor": self.lr_factor,
            "lr_until_step": self.state.lowered_until,
        }

    def stop_advice(self, event: dict[str, Any], can_roll_back: bool) -> str:
        """Why the run stops at `event` (the last skip), and what to change."""
        why = (
            f"after {self.state.streak} rollback(s) in a row (train.spike_rollbacks = "
            f"{self.max_rollbacks})"
            if can_roll_back
            else "with no save yet to roll back to (the first comes at step train.eval_interval, "
            "or train.save_interval)"
        )
        return (
            f"the spike guard skipped {len(self.state.skipped)} steps within "
            f"{self.window} steps (the last: step {event['step']}, {event['reason']}, loss "
            f"{event['loss']:.4g}) {why}: training cannot recover"
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain data for the resume state."""
        return asdict(self.state)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.state = GuardState.from_dict(saved)


class DivergenceError(InputError):
    """The loss became NaN or infinite (too high a learning rate, usually)."""


@dataclass(frozen=True)
class Divergence:
    """Stops a run whose loss became NaN or infinite, with a message that names the last good
    checkpoint and what to change.

    Attributes:
        train: the `train:` section (its learning rate is named).
        run_dir: where the last good checkpoint is.
        guarded: the spike guard is on (the message then also says to check the data).
    """

    train: TrainConfig
    run_dir: Path
    guarded: bool

    def check(self, losses: list[float], first_step: int, last_saved: int) -> None:
        """Raise `DivergenceError` at the first of `losses` (of steps `first_step`, ...) that
        is not finite; `last_saved` is the step of the last save (-1: none)."""
        for offset, value in enumerate(losses):
            if not math.isfinite(value):
                what = f"the loss became {value} at step {first_step + offset}: training diverged"
                raise self.error(what, last_saved)

    def error(self, what: str, last_saved: int) -> DivergenceError:
        """The error of a run that diverged: `what` happened, the last good checkpoint (the
        save of step `last_saved`, -1: none), and what to change."""
        lr = self.train.lr
        kept = (
            f"the last good checkpoint (step {last_saved}) in '{self.run_dir}' is intact"
            if last_saved >= 0
            else "no checkpoint was saved before it"
        )
        return DivergenceError(
            f"{what}, {kept}. Lower the learning rate (train.lr = {lr:g}; try --set "
            f"train.lr={lr / 3:.3g}), or raise train.warmup_steps or lower train.grad_clip"
            + (", and check the data around this step." if self.guarded else ".")
        )
