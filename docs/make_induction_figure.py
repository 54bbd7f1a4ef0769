"""Draw a run's validation loss and its strongest heads' probe scores against steps.

Usage (from the repository root, after `llmcli train induction`):

    python docs/make_induction_figure.py checkpoints/induction docs/induction.png

Reads the run's `metrics.jsonl` (evaluation records of a run trained with
`train.head_metrics`): the validation loss on the left axis, `induction_max` and
`prev_token_max` on the right one, so the loss dropping and the induction score jumping can be
seen together. Written atomically, with matplotlib's Agg backend, as llmcli's own pictures.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from llmcli.fileio import atomic_write_bytes
from llmcli.runs.metrics import read_metrics


def draw(run: Path, out: Path) -> None:
    evals = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "eval"]
    if not evals or "induction_max" not in evals[0]:
        sys.exit(f"{run}: no evaluation with head metrics (train with train.head_metrics: true)")
    steps = [r["step"] for r in evals]
    fig = Figure(figsize=(7.5, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    loss_ax = fig.add_subplot(1, 1, 1)
    loss_ax.plot(steps, [r["val_loss"] for r in evals], "o-", ms=2.5, color="tab:blue")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("val loss (nats/token)", color="tab:blue")
    loss_ax.grid(alpha=0.3)
    score_ax = loss_ax.twinx()
    for key, color in (("induction_max", "tab:red"), ("prev_token_max", "tab:gray")):
        score_ax.plot(steps, [r[key] for r in evals], "o-", ms=2.5, color=color, label=key)
    score_ax.set_ylim(0, 1.02)
    score_ax.set_ylabel("strongest head's score on the probe")
    score_ax.legend(loc="center right")
    loss_ax.set_title(f"{run.name}: the induction head forms as the loss drops")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    atomic_write_bytes(out, buffer.getvalue())


if __name__ == "__main__":
    draw(Path(sys.argv[1]), Path(sys.argv[2]))
