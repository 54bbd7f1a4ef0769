"""What the training loop reads from the device at log steps: the losses of the steps since the
last read (`LossLog`), the flags every rank must agree on (`agreed_flags`), and the tokens per
second between reads (`TokenRate`).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import torch

from llmcli.training.distributed import DistInfo, mean_over_ranks
from llmcli.training.interrupt import StopRequest
from llmcli.training.run import Run


class LossLog:
    """Each applied step's loss, kept on the device until the loop reads them all at once."""

    def __init__(self) -> None:
        self.pending: list[torch.Tensor] = []

    def add(self, loss: torch.Tensor) -> None:
        self.pending.append(loss)

    def clear(self) -> None:
        self.pending = []

    def read(self, info: DistInfo) -> list[float]:
        """The loss of each step since the last read (under DDP the mean over ranks, which
        step alike)."""
        values = torch.stack(self.pending)
        mean_over_ranks(values, info)
        self.pending = []
        return values.tolist()


@dataclass(frozen=True)
class Flags:
    """What any rank asks of all of them when the loop reads the device."""

    stop: bool = False  # Ctrl-C or SIGTERM: save and stop
    terminated: bool = False  # ... by SIGTERM (a scheduler's preemption): exit status 143
    timed_save: bool = False  # `train.save_interval_s` passed since the last save


def agreed_flags(run: Run, stop: StopRequest) -> Flags:
    """This rank's flags, raised on every rank if any rank raised them (one all-reduce under
    DDP), so that all learn at the same step that one of them was asked to stop or to save."""
    interval = run.config.train.save_interval_s
    flags = (
        stop.requested,
        stop.signum == signal.SIGTERM,
        interval is not None and time.perf_counter() - run.saved_at >= interval,
    )
    if run.info.enabled:
        raised = torch.tensor(flags, dtype=torch.float, device=run.device)
        mean_over_ranks(raised, run.info)
        flags = tuple(v > 0 for v in raised.tolist())
    return Flags(*flags)


class TokenRate:
    """Training tokens per second between reads; `restart` leaves evaluations and saves out."""

    def __init__(self, start: float, tokens: int) -> None:
        self.start, self.tokens = start, tokens

    def read(self, tokens: int) -> float:
        """Tokens per second since the last read or restart, which this read ends."""
        now = time.perf_counter()
        rate = (tokens - self.tokens) / max(now - self.start, 1e-9)
        self.start, self.tokens = now, tokens
        return rate

    def restart(self, tokens: int) -> None:
        self.start, self.tokens = time.perf_counter(), tokens

    def rewind(self, tokens: int) -> None:
        """After a rollback the count goes back: the rate counts from there (the time spent on
        the steps undone counts against it)."""
        self.tokens = min(self.tokens, tokens)
