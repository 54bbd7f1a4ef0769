"""Ctrl-C and SIGTERM during training: a request to save a checkpoint and stop, not a crash.

A training run must never lose more than the current step to an interrupt: `StopRequest` turns
the first SIGINT or SIGTERM (Ctrl-C, `kill`, a scheduler's preemption) into a flag that the loop
checks after each step; it then saves and exits: status 130 after Ctrl-C, 143 after SIGTERM
(128 + 15, what a process killed by SIGTERM reports: the status schedulers read as "preempted,
requeue me", for example Kubernetes' `podFailurePolicy` `onExitCodes`).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT): 128 + 2
EXIT_TERMINATED = 143  # SIGTERM: 128 + 15


class Preempted(KeyboardInterrupt):
    """Training saved and stopped after SIGTERM (a scheduler's preemption): exit status 143."""


class StopRequest:
    """Turns SIGINT (Ctrl-C) and SIGTERM into a request to save and stop after the current step.

    Alone, a second signal quits at once, with KeyboardInterrupt after `on_quit` (which says
    what that keeps and loses) (every file is written atomically, so even that leaves the last
    save loadable). Under torchrun (`escalate=False`) a second signal is expected, since
    torchrun forwards the terminal's Ctrl-C to workers that got it already, and only repeats
    the request. Installed only in the main thread, where signals arrive.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, escalate: bool = True, on_quit: Callable[[], Any] = lambda: None) -> None:
        self.requested = False
        self.signum: int | None = None  # the signal that asked first
        self.escalate, self.on_quit = escalate, on_quit
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:
            if self.escalate:
                self.on_quit()
                raise KeyboardInterrupt
            return
        self.requested, self.signum = True, signum
        logger.warning(
            "%s: saving a checkpoint after this step%s",
            signal.Signals(signum).name,
            " (Ctrl-C again quits at once, without saving)"
            if self.escalate and signum == signal.SIGINT
            else "",
        )

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
