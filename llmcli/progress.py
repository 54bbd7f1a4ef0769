"""Progress for long work: a tqdm bar on a terminal, plain log lines everywhere else.

A bar redraws itself with carriage returns many times a second, which reads well on a terminal
and fills a log file (CI, `nohup`, `2> train.log`) with thousands of lines. So a `Progress`
draws the bar only when stderr is a terminal; otherwise it logs one plain line (logger
`llmcli.progress`, INFO) at each `report` and, for counted work, at every tenth of the total.
`format_count` writes the large counts such lines and other messages show (1.2K, 3.4M).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


def stderr_is_terminal() -> bool:
    """True when stderr is an interactive terminal (where a bar can redraw in place)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


class Progress:
    """A progress display for `total` units of work.

    Args:
        total: units of work (None if unknown).
        desc: what is done, e.g. "train" or "tokenizing data/x.txt".
        unit: the unit's name for the bar, e.g. "step".
        initial: units already done (a resumed run).
        enabled: False shows nothing at all.
        tenths: off a terminal, also log a line at each tenth of `total` reached by `update`
            (for work whose caller has no natural moment to `report`).
        bar_options: more tqdm arguments for the terminal bar (e.g. `unit_scale=True`).
    """

    def __init__(
        self,
        total: int | None,
        *,
        desc: str,
        unit: str = "it",
        initial: int = 0,
        enabled: bool = True,
        tenths: bool = False,
        **bar_options: Any,
    ) -> None:
        self.total, self.desc, self.n = total, desc, initial
        self.live = enabled and stderr_is_terminal()
        self.plain = enabled and not self.live
        self._tenths = tenths and bool(total)
        self._next_tenth = self._tenth_after(initial)
        self._start = time.perf_counter()
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit=unit,
            dynamic_ncols=True,
            disable=not self.live,
            **bar_options,
        )

    def _tenth_after(self, n: int) -> int:
        if not self._tenths:
            return 0
        assert self.total is not None
        return (n * 10 // self.total + 1) * self.total // 10 or 1

    def update(self, n: int = 1) -> None:
        """Count `n` more units done."""
        self.n += n
        self.bar.update(n)
        if self.plain and self._tenths and self.n >= self._next_tenth:
            self._next_tenth = self._tenth_after(self.n)
            self._line({})

    def report(self, fields: dict[str, str]) -> None:
        """Show figures of the moment: beside the bar on a terminal, else as one log line."""
        if self.live:
            self.bar.set_postfix(fields, refresh=False)
        elif self.plain:
            self._line(fields)

    def _line(self, fields: dict[str, str]) -> None:
        done = f"{self.n:,}/{self.total:,}" if self.total else f"{self.n:,}"
        figures = "".join(f", {key} {value}" for key, value in fields.items())
        elapsed = time.perf_counter() - self._start
        logger.info("%s %s%s, %.0f s", self.desc, done, figures, elapsed)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def format_count(n: int) -> str:
    """1234 -> "1.2K", 3.4e6 -> "3.4M" (parameter counts in messages)."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:,.1f}{unit}"
    return str(n)


def format_bytes(n: float) -> str:
    """A memory size in powers of 1024: 812 B, 3.4 MiB, 120 MiB, 1.2 GiB."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    while abs(n) >= 1024 and len(units) > 1:
        n, units = n / 1024, units[1:]
    return f"{n:,.0f} {units[0]}" if units[0] == "B" or abs(n) >= 100 else f"{n:.1f} {units[0]}"
