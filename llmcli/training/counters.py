"""The training loop's counters: the step, the tokens, the time and the best evaluation so far."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field


@dataclass
class TrainState:
    """The training loop's counters: saved with every checkpoint (`ResumeState`), restored by
    `--resume`.

    Attributes:
        step: optimizer steps done.
        tokens: training tokens seen, over every rank.
        elapsed_base: training seconds of the sessions before this one.
        best_val_loss: the lowest validation loss so far (inf before the first evaluation).
        best_step: the step of `best_val_loss`.
        last_eval: the latest evaluation's mean loss per split ("train", "val").
        eval_pending: the evaluation due at `step` has not run yet (a stop saved before it: the
            resumed run makes it first).
        last_saved: the step of the latest save in this run (-1: none yet); not saved.
        session_start: `time.perf_counter()` when this session started; not saved.
    """

    step: int = 0
    tokens: int = 0
    elapsed_base: float = 0.0
    best_val_loss: float = math.inf
    best_step: int | None = None
    last_eval: dict[str, float] = field(default_factory=dict)
    eval_pending: bool = False
    last_saved: int = -1
    session_start: float = field(default_factory=time.perf_counter)

    @property
    def elapsed(self) -> float:
        """Training seconds so far, earlier sessions included."""
        return self.elapsed_base + time.perf_counter() - self.session_start

    def take(self, other: TrainState, but: tuple[str, ...]) -> None:
        """Take `other`'s counters, in place (others hold this object), `but` those named."""
        for counter in dataclasses.fields(self):
            if counter.name not in but:
                setattr(self, counter.name, getattr(other, counter.name))

    def record_eval(self, losses: dict[str, float]) -> bool:
        """Keep an evaluation's losses; True when its val loss is the best so far."""
        self.last_eval = losses
        best = losses["val"] < self.best_val_loss
        if best:
            self.best_val_loss, self.best_step = losses["val"], self.step
        return best
