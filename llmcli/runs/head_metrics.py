"""The per-head grids of every evaluation: `head_metrics.jsonl`, written and read back.

With `train.head_metrics`, rank 0 appends one JSON object per evaluation: `step`, `tokens`, the
probe it scored on (`llmcli.evaluation.probe`), each head's score of each kind as an `n_layer x
n_head` grid (`prev_token`, `induction`, `duplicate_token`), the validation loss at each
position of the context (`val_loss_by_position`) and the `icl_score` taken from it. Each record
is one write of one line, flushed, so a crash can only leave a torn last line, which readers
skip. It is a `llmcli.runs.metrics.JsonLinesLog`: a resumed run cuts it back to its size at the
save it resumes from and writes the later records again rather than twice; readers also keep
only the last record of a step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmcli.fileio import atomic_write_bytes
from llmcli.runs.metrics import log_lines


def read_head_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a `head_metrics.jsonl`, one per step (the last written), by step."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return []
    by_step = {record["step"]: record for _, record in log_lines(data)}
    return [by_step[step] for step in sorted(by_step)]


def cut_to_step(path: Path, step: int) -> int:
    """Keep only the records of steps up to `step` in a `head_metrics.jsonl`, and return its
    size: how a run resumed from the save of `step` cuts the file when its resume state does
    not record the size (states written before it did). It keeps what the size would: records
    come only from evaluations, each followed by a save, so none written before a save is of a
    later step, and none written after it of an earlier one."""
    if path.exists():
        kept = [line for line, record in log_lines(path.read_bytes()) if record["step"] <= step]
        atomic_write_bytes(path, b"".join(kept))
    return path.stat().st_size if path.exists() else 0
