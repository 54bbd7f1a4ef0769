"""Progress for long work: a tqdm bar on a terminal, plain log lines everywhere else.

A bar redraws itself with carriage returns many times a second, which reads well on a terminal
and fills a log file (CI, `nohup`, `2> train.log`) with thousands of lines. So a `Progress`
draws the bar only when stderr is a terminal wide enough for one; otherwise it logs one plain
line (logger `llmcli.progress`, INFO) at each `report` and, for counted work, at every tenth of
the total.
`format_count` writes the large counts such lines and other messages show (1.2K, 3.4M),
`counted` an exact count with its noun ("1 pair", "1,200 pairs"), `first_few` the first rows of
a list, and `format_fixed` the figures of printed tables (never `-0.000`).
"""

from __future__ import annotations

import logging
import math
import os
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


# Narrower than this, tqdm trims the bar to nothing (a pty whose size was never set, as in
# `docker run -t`, reports 0 columns): plain lines are shown instead.
MIN_BAR_COLUMNS = 10


def stderr_is_terminal() -> bool:
    """True when stderr is an interactive terminal (where a bar can redraw in place)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


def stderr_columns() -> int | None:
    """The width of the terminal stderr writes to; None when it is unknown."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, ValueError, OSError):  # no descriptor, or not a terminal
        return None


def stderr_bar_fits() -> bool:
    """True when stderr is a terminal wide enough for a bar (or of unknown width)."""
    if not stderr_is_terminal():
        return False
    columns = stderr_columns()
    return columns is None or columns >= MIN_BAR_COLUMNS


# A bar without tqdm's own rate, for work that reports a better one (training's tok/s): on an
# 80-column terminal, the loss and the speed then fit beside a bar.
WITHOUT_RATE = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"
# Columns a bar leaves free at the right: the terminal echoes Ctrl-C as "^C" where the bar
# ends, and on a full line that would wrap below, where clearing the line cannot reach it.
ECHO_ROOM = 3


def _with_room_for_echo(columns: int | None, rows: int | None) -> tuple[int | None, int | None]:
    return (columns - ECHO_ROOM if columns and columns > ECHO_ROOM else columns), rows


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
        self.live = enabled and stderr_bar_fits()
        self.plain = enabled and not self.live
        self._tenths = tenths and bool(total)
        self._tenths_done = 0
        self._pass_tenths(initial)
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
        if callable(shape := getattr(self.bar, "dynamic_ncols", None)):  # the terminal's size
            self.bar.dynamic_ncols = lambda fp: _with_room_for_echo(*shape(fp))

    def _tenth(self, k: int) -> int:
        """The count at which tenth `k` (1..10) is reached: ceil(k * total / 10)."""
        assert self.total is not None
        return -(-k * self.total // 10)

    def _pass_tenths(self, n: int) -> bool:
        """Count the tenths that `n` units reach; True if any was new. A total under 10 has
        tenths that fall on the same count, which reach it together: one line, not several."""
        if not self._tenths:
            return False
        before = self._tenths_done
        while self._tenths_done < 10 and self._tenth(self._tenths_done + 1) <= n:
            self._tenths_done += 1
        return self._tenths_done > before

    def update(self, n: int = 1) -> None:
        """Count `n` more units done."""
        self.n += n
        self.bar.update(n)
        if self._pass_tenths(self.n) and self.plain:
            self._line({})

    def report(self, fields: dict[str, str]) -> None:
        """Show figures of the moment: beside the bar on a terminal (as many as fit its width
        beside a bar of `MIN_BAR_COLUMNS` cells, the first ones first), else as one log line."""
        if self.live:
            self.bar.set_postfix(self._fitting(fields), refresh=False)
        elif self.plain:
            self._line(fields)

    def _fitting(self, fields: dict[str, str]) -> dict[str, str]:
        """The first of `fields` that fit beside the bar on this terminal."""
        columns = self.bar.format_dict["ncols"] or stderr_columns()
        shown = dict(fields)
        while shown:
            postfix = ", ".join(f"{key}={value}" for key, value in shown.items())
            meter = {**self.bar.format_dict, "postfix": postfix, "ncols": None}
            if columns is None or len(self.bar.format_meter(**meter)) <= columns - 1:
                break
            shown.popitem()  # a bar with the fields cut off at the edge reads worse
        return shown

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


def counted(n: int, word: str, plural: str | None = None) -> str:
    """`n` and the noun for it: "1 pair", "0 pairs", "12,000 conversations"; `plural` for a
    noun that does not take an s ("1 reply", plural "replies")."""
    return f"{n:,} {word if n == 1 else plural or word + 's'}"


def first_few(items: Sequence[str], shown: int = 3) -> str:
    """The first `shown` of `items`, joined, and how many more there are."""
    head = ", ".join(items[:shown])
    return head if len(items) <= shown else f"{head} and {len(items) - shown:,} more"


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


def format_fixed(value: float, spec: str) -> str:
    """`format(value, spec)`, but a value that rounds to zero has no minus sign: -0.0001 with
    ".3f" is "0.000", not "-0.000" (Python 3.11's "z" option, for Python 3.10 too)."""
    text = format(value, spec)
    if math.copysign(1.0, value) < 0 and "-" in text:
        try:
            rounds_to_zero = float(text) == 0.0
        except ValueError:  # a spec with grouping or a unit: leave it as it is
            rounds_to_zero = False
        if rounds_to_zero:
            text = format(0.0, spec)
    return text


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far: what it took from the system at most."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
