"""The per-head grids of every evaluation: `head_metrics.jsonl`, written and read back.

With `train.head_metrics`, rank 0 appends one JSON object per evaluation: `step`, `tokens`, the
probe it scored on (`llmcli.evaluation.probe`), each head's score of each kind as an `n_layer x
n_head` grid (`prev_token`, `induction`, `duplicate_token`), the validation loss at each
position of the context (`val_loss_by_position`) and the `icl_score` taken from it. Each record
is one write of one line, flushed, so a crash can only leave a torn last line, which readers
skip. A resumed run first drops the records after the step it resumes from (the evaluation of a
step is written before that step's save), so it writes them again rather than twice; readers
also keep only the last record of a step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmcli.fileio import append_json_line, atomic_write_bytes


def _records(data: bytes) -> list[tuple[bytes, dict[str, Any]]]:
    """(line, record) of each whole JSON object line in `data`; torn or foreign lines skipped."""
    out = []
    for line in data.splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out.append((line if line.endswith(b"\n") else line + b"\n", record))
    return out


class HeadMetricsLog:
    """Appends one record per evaluation to `head_metrics.jsonl` (rank 0).

    Args:
        path: the file.
        resumed_from: the step a resumed run continues from (records after it are dropped);
            None for a fresh start, which starts the file afresh.
    """

    def __init__(self, path: Path, resumed_from: int | None) -> None:
        self.path = path
        if resumed_from is not None and path.exists():
            kept = [line for line, r in _records(path.read_bytes()) if r["step"] <= resumed_from]
            atomic_write_bytes(path, b"".join(kept))
        elif resumed_from is None and path.exists():
            path.unlink()
        self._fh = open(path, "ab")  # noqa: SIM115 - closed by close()

    def write(self, record: dict[str, Any]) -> None:
        append_json_line(self._fh, self.path, record)

    def close(self) -> None:
        self._fh.close()


def read_head_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a `head_metrics.jsonl`, one per step (the last written), by step."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return []
    by_step = {record["step"]: record for _, record in _records(data)}
    return [by_step[step] for step in sorted(by_step)]
