"""The training log: `metrics.jsonl`, reading it back, and the loss-curve picture.

Rank 0 appends one JSON object per logged step (`"kind": "train"`), per evaluation (`"kind":
"eval"`) and per spike-guard event (`"kind": "event"`, `llmcli.training.guard`), and hands each to
the run's experiment trackers (`llmcli.runs.trackers`). The file is a `JsonLinesLog`: a resumed
run cuts it back to its size at the save it resumes from and writes the later records again
rather than twice. `loss.png` is redrawn from the file at every evaluation.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from llmcli.fileio import append_json_line, atomic_write_bytes, write_figure
from llmcli.runs.trackers import Trackers


class JsonLinesLog:
    """An append-only log of JSON records, one line each: a run's `metrics.jsonl` and
    `head_metrics.jsonl`, an SAE's `metrics.jsonl`.

    Each record is one write of one line, flushed, so a crash can only leave a torn last line,
    which readers skip. One rule says what a restart keeps: every save records the log's size
    (`size`), and a run resumed from a save cuts the log back to that size, so that it writes
    the records after the save again rather than twice; a fresh start empties the file.

    Args:
        path: the file.
        keep_bytes: its size at the save a run resumes from; None for a fresh start.
        trackers: receive every record written too (TensorBoard, W&B).
    """

    def __init__(
        self, path: Path, keep_bytes: int | None, trackers: Trackers | None = None
    ) -> None:
        self.path = path
        self.trackers = trackers
        if keep_bytes is not None and path.exists() and path.stat().st_size > keep_bytes:
            atomic_write_bytes(path, path.read_bytes()[:keep_bytes])
        elif keep_bytes is None and path.exists():
            path.unlink()
        self._fh = open(path, "ab")  # noqa: SIM115 - closed by close()
        self.size = self._fh.tell()

    def write(self, record: dict[str, Any]) -> None:
        self.size += append_json_line(self._fh, self.path, record)
        if self.trackers is not None:
            self.trackers.log(record)

    def rewind(self, size: int) -> None:
        """Cut the file back to `size` bytes (the save a spike-guard rollback goes back to),
        keeping the event records written after it: what was skipped stays on record, and the
        steps the run does again are written again."""
        self._fh.close()
        data = self.path.read_bytes()
        events = [line for line, record in log_lines(data[size:]) if record.get("kind") == "event"]
        atomic_write_bytes(self.path, data[:size] + b"".join(events))
        self._fh = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        self.size = self._fh.tell()

    def close(self) -> None:
        self._fh.close()
        if self.trackers is not None:
            self.trackers.close()


def log_lines(data: bytes) -> list[tuple[bytes, dict[str, Any]]]:
    """`(line, record)` of each whole line of a log that holds a JSON object with an integer
    `step`; torn or foreign lines are skipped."""
    out = []
    for line in data.splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out.append((line if line.endswith(b"\n") else line + b"\n", record))
    return out


# The fields of a record that llmcli reads, all numbers (NaN and infinities included: a
# diverging loss is logged as it was).
NUMBER_FIELDS = (
    "tokens",
    "elapsed_s",
    "lr",
    "train_loss",
    "grad_norm",
    "tok_per_s",
    "mfu",
    "val_loss",
    "val_ppl",
    "induction_max",
    "prev_token_max",
    "icl_score",
)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl`, each with the types llmcli reads it as.

    A record is kept when it is a JSON object with a non-negative integer `step`; within it, a
    `kind` that is not a string or a field of `NUMBER_FIELDS` that is not a number is left out.
    A line that is not JSON (a torn last line, from a crash) is skipped. The file is a log, so
    nothing in it is an error: a reader shows what is right.
    """
    records = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return records
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and _is_count(record.get("step")):
            records.append({k: v for k, v in record.items() if _field_ok(k, v)})
    return records


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _field_ok(key: str, value: Any) -> bool:
    if key == "kind":
        return isinstance(value, str)
    if key in NUMBER_FIELDS:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


def plot_losses(metrics_path: Path, out_path: Path) -> None:
    """Draw train and val loss against steps from `metrics.jsonl` into a PNG (atomically)."""
    records = read_metrics(metrics_path)
    train = [
        (r["step"], r["train_loss"])
        for r in records
        if r.get("kind") == "train" and "train_loss" in r
    ]
    evals = [r for r in records if r.get("kind") == "eval" and {"train_loss", "val_loss"} <= set(r)]
    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if train:
        ax.plot(
            *zip(*train, strict=True), color="tab:blue", alpha=0.45, lw=1, label="train (batch)"
        )
    if evals:
        steps = [r["step"] for r in evals]
        ax.plot(
            steps,
            [r["train_loss"] for r in evals],
            "o-",
            color="tab:blue",
            ms=3,
            label="train (eval)",
        )
        ax.plot(steps, [r["val_loss"] for r in evals], "o-", color="tab:orange", ms=3, label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(metrics_path.parent.name)
    ax.grid(alpha=0.3)
    if train or evals:
        ax.legend()
    fig.tight_layout()
    write_figure(out_path, fig)


def best_eval(records: list[dict[str, Any]]) -> tuple[float | None, int | None]:
    """The lowest `val_loss` among the records and its step (None when the run never evaluated)."""
    best: tuple[float | None, int | None] = (None, None)
    for record in records:
        val = record.get("val_loss")
        if (
            isinstance(val, (int, float))
            and math.isfinite(val)
            and (best[0] is None or val < best[0])
        ):
            best = (float(val), record.get("step"))
    return best


def best_figures(
    records: list[dict[str, Any]], best_step: int | None, meta: dict[str, Any]
) -> tuple[bool, dict[str, Any]]:
    """What says how a run does at its best evaluation (`best_step`), by the figures its
    objective names in `meta.json` (`figures`; a run from before them: the loss alone):
    (whether its loss means something to show, the other figures by name, None where the
    evaluation did not record one)."""
    names = meta.get("figures") or ["val_loss"]
    at_best = next(
        (r for r in records if r.get("kind") == "eval" and r.get("step") == best_step), {}
    )
    return "val_loss" in names, {n: at_best.get(n) for n in names if n != "val_loss"}


def format_figures(figures: dict[str, Any]) -> str:
    """Figures as `info` and `compare` show them: `val reward 0.5000, val pass@1 75.0%` (shares,
    pass@1 and accuracies, in percent)."""
    shown = []
    for name, value in figures.items():
        if not isinstance(value, (int, float)):
            text = "not recorded"
        elif name.endswith(("pass@1", "accuracies")):
            text = f"{value:.1%}"
        else:
            text = f"{value:.4f}"
        shown.append(f"{name.replace('_', ' ')} {text}")
    return ", ".join(shown)
