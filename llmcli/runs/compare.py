"""`llmcli compare`: several runs side by side, their curves in one picture and a table.

It reads only what any run directory holds (`metrics.jsonl`, `config.yaml`, `meta.json`), so it
works on runs trained anywhere. The table gives each run's best val loss (where its objective's
loss is one: not GRPO's negated reward) and its step, steps, tokens, training time and tokens
per second of it, the figures its objective names at that evaluation (meta.json's `figures`:
GRPO's reward and pass@1, DPO's reward accuracy and margin), and the config keys whose values differ
between the runs (only those). With `reference`, each run's shipped config's reference curve
(`llmcli.runs.reference`) is drawn too, and each run is placed against it.
"""

from __future__ import annotations

import glob
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from llmcli.errors import InputError, describe_os_error
from llmcli.fileio import write_figure
from llmcli.runs.directory import CONFIG_FILE, META_FILE, METRICS_FILE
from llmcli.runs.formats import read_meta
from llmcli.runs.loading import load_config_file
from llmcli.runs.metrics import best_eval, best_figures, format_figures, read_metrics
from llmcli.runs.reference import (
    ReferenceCheck,
    check_run,
    describe,
    flat_config,
    load_reference,
)

logger = logging.getLogger(__name__)

X_AXES = ("step", "tokens", "elapsed_s")
# Curves of fewer points than this get a marker at each (a line alone would hide them).
MARKERS_BELOW = 50
# The largest magnitude drawn: matplotlib's axis limits overflow a float between two values
# near the largest float (1.8e308).
DRAWABLE = 1e300
# The metrics a reference curve gives (it holds val_loss; val_ppl is its exponential).
REFERENCE_METRICS = ("val_loss", "val_ppl")
# The metrics a run logs only with train.head_metrics.
HEAD_METRICS = ("induction_max", "prev_token_max", "icl_score")
# Each metric, and the kind of record that holds it.
METRICS = {
    "val_loss": "eval",
    "val_ppl": "eval",
    "induction_max": "eval",
    "prev_token_max": "eval",
    "icl_score": "eval",
    "train_loss": "train",
    "lr": "train",
    "grad_norm": "train",
    "tok_per_s": "train",
}


@dataclass
class RunSummary:
    """One run's line of the table."""

    run: str
    best_val_loss: float | None
    best_step: int | None
    steps: int | None
    tokens: int | None
    elapsed_s: float | None
    tokens_per_s: float | None
    differs: dict[str, Any] = field(default_factory=dict)
    reference: ReferenceCheck | None = None
    # The run's objective's figures at its best evaluation (GRPO's reward and pass@1, DPO's
    # reward accuracy and margin); `best_val_loss` is None where its loss means nothing.
    best_figures: dict[str, Any] = field(default_factory=dict)


@dataclass
class Comparison:
    """What `compare_runs` found: a line per run, the differing keys, the picture's path."""

    runs: list[RunSummary]
    differing_keys: list[str]
    metric: str
    x: str
    picture: Path | None
    replaced: bool = False  # the picture took the place of a file already there

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "x": self.x,
            "picture": str(self.picture) if self.picture else None,
            "differing_keys": self.differing_keys,
            "runs": [asdict(r) for r in self.runs],
        }


def expand_runs(specs: list[str], minimum: int = 2) -> list[Path]:
    """Run directories from paths and globs (`checkpoints/*`), in the order given.

    Raises:
        InputError: a spec matching nothing, a folder that is not a run, fewer than `minimum`
            runs.
    """
    runs: list[Path] = []
    for spec in specs:
        matches = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
        if not matches:
            raise InputError(f"{spec!r} matches no run directory.")
        for match in matches:
            path = Path(match)
            if not (path / METRICS_FILE).is_file() or not (path / CONFIG_FILE).is_file():
                if glob.has_magic(spec) and path.is_dir():
                    continue  # a glob may also match other folders
                raise InputError(
                    f"'{path}' is not a run directory: it has no {METRICS_FILE} and "
                    f"{CONFIG_FILE} (give folders that `llmcli train` wrote)."
                )
            runs.append(path)
    if len(runs) < minimum:
        raise InputError(
            f"compare needs at least two runs (or one with --reference); got {len(runs)}: {specs}."
        )
    return runs


def _summary(run: Path, records: list[dict[str, Any]]) -> RunSummary:
    meta = read_meta(run / META_FILE)
    best, best_step = best_eval(records)
    shows_loss, figures = best_figures(records, best_step, meta)
    last = records[-1] if records else {}
    tokens, elapsed = meta.get("tokens"), meta.get("elapsed_s")
    if tokens is None:  # not recorded (or left out as malformed): the metrics' own figure
        tokens = last.get("tokens")
    if elapsed is None:
        elapsed = last.get("elapsed_s")
    return RunSummary(
        run=str(run),
        best_val_loss=best if shows_loss else None,
        best_step=best_step,
        steps=meta.get("step", last.get("step")),
        tokens=tokens,
        elapsed_s=elapsed,
        tokens_per_s=tokens / elapsed if tokens and elapsed else None,
        best_figures=figures,
    )


def compare_runs(
    specs: list[str],
    *,
    metric: str = "val_loss",
    x: str = "step",
    out: str | Path | None = None,
    reference: bool = False,
) -> Comparison:
    """Compare runs: a PNG of `metric` against `x` for each run (to `out`) and the table.

    Args:
        specs: run directories or globs.
        metric: one of `METRICS`.
        x: one of `X_AXES`.
        out: where to write the PNG (None: no picture); a file already there is replaced,
            which `Comparison.replaced` says.
        reference: also draw each run's reference curve and place each run against it (then
            one run is enough, and the metric is val_loss or val_ppl).

    Raises:
        InputError: a bad run, metric or axis; a metric no run recorded; an unwritable `out`.
    """
    if metric not in METRICS:
        raise InputError(f"--metric {metric!r} is not one of {', '.join(METRICS)}.")
    if x not in X_AXES:
        raise InputError(f"--x {x!r} is not one of {', '.join(X_AXES)}.")
    if reference and metric not in REFERENCE_METRICS:
        raise InputError(
            f"--reference draws the reference runs' validation loss: use --metric val_loss or "
            f"val_ppl with it, not {metric!r}."
        )
    runs = expand_runs(specs, minimum=1 if reference else 2)
    records = {run: read_metrics(run / METRICS_FILE) for run in runs}
    _check_recorded(records, metric, x)
    # Validated, with the defaults of any key an older run's config.yaml lacks.
    nested = {run: load_config_file(run).to_dict() for run in runs}
    configs = {run: flat_config(config) for run, config in nested.items()}
    keys = sorted({k for c in configs.values() for k in c})
    differing = [k for k in keys if len({repr(c.get(k)) for c in configs.values()}) > 1]
    summaries = []
    for run in runs:
        summary = _summary(run, records[run])
        summary.differs = {k: configs[run].get(k) for k in differing}
        if reference:
            summary.reference = check_run(run, nested[run])
        summaries.append(summary)
    picture, replaced = None, False
    if out is not None:
        picture = Path(out)
        replaced = picture.exists()
        curves = _reference_curves(summaries)
        try:
            write_figure(picture, curves_figure(records, metric, x, curves))
        except OSError as exc:
            raise InputError(f"cannot write '{picture}': {describe_os_error(exc)}.") from None
    return Comparison(summaries, differing, metric, x, picture, replaced)


def _check_recorded(records: dict[Path, list[dict[str, Any]]], metric: str, x: str) -> None:
    """Raise an `InputError` naming the runs whose metrics.jsonl lacks `metric` against `x`."""
    missing = [str(r) for r, recs in records.items() if not _points(recs, metric, x)]
    if missing:
        hint = (
            " (it is logged at evaluations with train.head_metrics: true)"
            if metric in HEAD_METRICS
            else " (it is logged at evaluations, every train.eval_interval steps: a run stopped "
            "before its first has none)"
            if metric.startswith("val_")
            else ""
        )
        # What every run does record, train_loss first: the curve that can be drawn instead.
        recorded = [
            m
            for m in ("train_loss", *METRICS)
            if m != metric and all(_points(recs, m, x) for recs in records.values())
        ]
        instead = f" Every run records {recorded[0]}: --metric {recorded[0]}." if recorded else ""
        raise InputError(
            f"metric {metric!r} (against {x}) is not in the metrics.jsonl of: "
            f"{', '.join(missing)}{hint}.{instead}"
        )


def _reference_curves(summaries: list[RunSummary]) -> dict[str, list[dict[str, Any]]]:
    """Each reference the runs were placed against, by name: its points."""
    names = [s.reference.name for s in summaries if s.reference and s.reference.path]
    curves = {}
    for name in dict.fromkeys(names):
        loaded = load_reference(name)
        if loaded is not None:
            curves[name] = loaded.points
    return curves


def _points(records: list[dict[str, Any]], metric: str, x: str) -> list[tuple[float, float]]:
    kind = METRICS[metric]
    return [
        (r[x], r[metric])
        for r in records
        if r.get("kind") == kind
        and isinstance(r.get(metric), (int, float))
        and isinstance(r.get(x), (int, float))
        and math.isfinite(r[metric])
    ]


def curves_figure(
    records: dict[Path, list[dict[str, Any]]],
    metric: str,
    x: str,
    references: dict[str, list[dict[str, Any]]] | None = None,
) -> Figure:
    """The runs' curves of `metric` against `x`, one per run (its records) named by its folder,
    and each reference's dashed."""
    fig = Figure(figsize=(7.5, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for run, recs in records.items():
        points = _points(recs, metric, x)
        drawn = [(px, py) for px, py in points if max(abs(px), abs(py)) <= DRAWABLE]
        if len(drawn) < len(points):
            logger.warning(
                "%s: %d point(s) of %s beyond +-%g are left out of the picture",
                run,
                len(points) - len(drawn),
                metric,
                DRAWABLE,
            )
        # Markers on evaluations and on short curves: a run of one point has no line to show.
        marker = "o" if METRICS[metric] == "eval" or len(drawn) < MARKERS_BELOW else None
        if drawn:
            ax.plot(*zip(*drawn, strict=True), marker=marker, ms=3, lw=1.2, label=run.name)
    for name, points in (references or {}).items():
        drawn = [p for p in points if isinstance(p.get(x), (int, float))]
        values = [p["val_loss"] if metric == "val_loss" else math.exp(p["val_loss"]) for p in drawn]
        ax.plot(
            [p[x] for p in drawn], values, "--", color="0.3", lw=1.2, label=f"reference: {name}"
        )
    ax.set_xlabel({"step": "step", "tokens": "tokens", "elapsed_s": "seconds of training"}[x])
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def format_table(comparison: Comparison) -> str:
    """The table as aligned text: one row per run; then one row per differing config key."""
    runs = comparison.runs
    # tokens over the run's whole time (start-up and evaluations too), not the training loop's
    # own rate that `llmcli train` prints
    rows = [["run", "best val", "at step", "steps", "tokens", "time s", "tokens/s"]]
    figures = any(r.best_figures for r in runs)  # an objective's own (GRPO's reward, ...)
    if figures:
        rows[0].append("at best")
    for r in runs:
        rows.append(
            [
                Path(r.run).name,
                "-" if r.best_val_loss is None else f"{r.best_val_loss:.4f}",
                "-" if r.best_step is None else str(r.best_step),
                "-" if r.steps is None else str(r.steps),
                "-" if r.tokens is None else f"{r.tokens:,}",
                "-" if r.elapsed_s is None else f"{r.elapsed_s:.1f}",
                "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
                *([format_figures(r.best_figures) or "-"] if figures else []),
            ]
        )
    text = _aligned(rows)
    if comparison.differing_keys:
        keys = [["config keys that differ", *(Path(r.run).name for r in runs)]]
        keys += [[k, *(str(r.differs.get(k)) for r in runs)] for k in comparison.differing_keys]
        text += "\n\n" + _aligned(keys)
    checks = [(Path(r.run).name, r.reference) for r in runs if r.reference is not None]
    if checks:
        text += "\n\n" + "\n".join(
            f"{run}: {label}: {value}" for run, check in checks for label, value in describe(check)
        )
    return text


def _aligned(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )
