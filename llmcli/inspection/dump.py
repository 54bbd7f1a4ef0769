"""The attention dump: one prompt's per-head attention and head metrics, and its files.

`AttentionDump` holds the maps `[L', H', T, T]` of the selected layers and heads, the tokens and
the metrics; `save_dump` writes it as `attention.npz` (or `.safetensors` / `.json`), `load_dump`
reads any of the three back, and `format_metrics_table` prints the metrics as a text table.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from llmcli.errors import InputError
from llmcli.fileio import atomic_path, atomic_write_text
from llmcli.progress import format_fixed

#: Dump formats and their file suffixes.
FORMATS: dict[str, str] = {"npz": ".npz", "safetensors": ".safetensors", "json": ".json"}


@dataclass
class AttentionDump:
    """One prompt's captured attention and head metrics (what `attention.npz` holds).

    Attributes:
        attn: float32 `[L', H', T, T]` for the selected layers and heads (query x key).
        tokens: the decoded text of each token, `T` strings.
        token_ids: int64 `[T]`.
        metrics: float32 `[L', H', M]`.
        metric_names: `M` names, see `metrics.METRIC_NAMES` (+ `metrics.INDUCTION`).
        layers: the model layer index of each row of `attn` (`L'` ints).
        heads: the model head index of each column of `attn` (`H'` ints).
        meta: checkpoint path and weights sha256, prompt, config, versions, selection.
    """

    attn: np.ndarray
    tokens: list[str]
    token_ids: np.ndarray
    metrics: np.ndarray
    metric_names: list[str]
    layers: list[int]
    heads: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    def arrays(self) -> dict[str, np.ndarray]:
        """The dump as named NumPy arrays (no object dtypes: loads with allow_pickle=False)."""
        return {
            "attn": np.ascontiguousarray(self.attn, dtype=np.float32),
            "tokens": np.array(self.tokens, dtype=np.str_).reshape(len(self.tokens)),
            "token_ids": np.asarray(self.token_ids, dtype=np.int64),
            "metrics": np.ascontiguousarray(self.metrics, dtype=np.float32),
            "metric_names": np.array(self.metric_names, dtype=np.str_),
            "layers": np.asarray(self.layers, dtype=np.int64),
            "heads": np.asarray(self.heads, dtype=np.int64),
            "meta": np.array(json.dumps(self.meta, sort_keys=True)),
        }


def _json_floats(a: np.ndarray) -> Any:
    """Nested lists of Python floats, NaN as None (JSON has no NaN)."""
    return [_json_floats(x) for x in a] if a.ndim else (None if np.isnan(a) else float(a))


def save_dump(dump: AttentionDump, path: str | Path, fmt: str = "npz") -> Path:
    """Write a dump atomically as `npz`, `safetensors` or `json`; returns the path.

    - npz: the arrays of `AttentionDump.arrays()`, `meta` a 0-d JSON string.
    - safetensors: the numeric arrays as tensors; `tokens`, `metric_names` and `meta` as JSON
      strings in the header metadata (safetensors holds no string tensors).
    - json: one object with the same keys; `meta` is an object, NaN metrics are null.
    """
    path = Path(path)
    if fmt not in FORMATS:
        raise InputError(f"unknown dump format {fmt!r}: choose one of {', '.join(FORMATS)}.")
    arrays = dump.arrays()
    path.parent.mkdir(parents=True, exist_ok=True)  # callers may name a new folder
    if fmt == "npz":
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)
    elif fmt == "safetensors":
        tensors = {k: arrays[k] for k in ("attn", "token_ids", "metrics", "layers", "heads")}
        metadata = {
            "tokens": json.dumps(dump.tokens),
            "metric_names": json.dumps(dump.metric_names),
            "meta": json.dumps(dump.meta, sort_keys=True),
        }
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)
    else:
        obj = {
            "attn": _json_floats(arrays["attn"]),
            "tokens": list(dump.tokens),
            "token_ids": [int(i) for i in arrays["token_ids"]],
            "metrics": _json_floats(arrays["metrics"]),
            "metric_names": list(dump.metric_names),
            "layers": [int(i) for i in dump.layers],
            "heads": [int(i) for i in dump.heads],
            "meta": dump.meta,
        }
        atomic_write_text(path, json.dumps(obj, allow_nan=False))
    return path


def load_dump(path: str | Path) -> AttentionDump:
    """Read a dump written by `save_dump` in any of the three formats (chosen by suffix)."""
    path = Path(path)
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            a = {k: z[k] for k in z.files}
        tokens, names, meta = list(a["tokens"]), list(a["metric_names"]), json.loads(str(a["meta"]))
    elif path.suffix == ".safetensors":
        a = load_file(str(path))
        with safe_open(str(path), framework="numpy") as f:
            md = f.metadata()
        tokens, names, meta = (
            json.loads(md["tokens"]),
            json.loads(md["metric_names"]),
            json.loads(md["meta"]),
        )
    elif path.suffix == ".json":
        obj = json.loads(path.read_text(encoding="utf-8"))
        a = {
            "attn": np.array(obj["attn"], dtype=np.float32),
            "token_ids": np.array(obj["token_ids"], dtype=np.int64),
            "metrics": np.array(obj["metrics"], dtype=np.float64),
            "layers": np.array(obj["layers"], dtype=np.int64),
            "heads": np.array(obj["heads"], dtype=np.int64),
        }
        tokens, names, meta = obj["tokens"], obj["metric_names"], obj["meta"]
    else:
        raise InputError(f"{str(path)!r} is not a dump: expected a .npz, .safetensors or .json.")
    return AttentionDump(
        attn=a["attn"].astype(np.float32).reshape(a["attn"].shape),
        tokens=[str(t) for t in tokens],
        token_ids=a["token_ids"].astype(np.int64),
        metrics=a["metrics"].astype(np.float32),
        metric_names=[str(n) for n in names],
        layers=[int(i) for i in a["layers"]],
        heads=[int(i) for i in a["heads"]],
        meta=meta,
    )


def format_metrics_table(dump: AttentionDump) -> str:
    """The head metrics as a text table: one row per (layer, head), one column per metric."""
    names = dump.metric_names
    width = max(8, *(len(n) for n in names))
    lines = ["layer head  " + "  ".join(f"{n:>{width}}" for n in names)]
    for i, layer in enumerate(dump.layers):
        for j, head in enumerate(dump.heads):
            cells = "  ".join(
                f"{'-':>{width}}" if math.isnan(v) else format_fixed(v, f">{width}.3f")
                for v in dump.metrics[i, j].tolist()
            )
            lines.append(f"{layer:>5} {head:>4}  {cells}")
    return "\n".join(lines)
