"""A run's lens, patching and attribution results as grids for the viewer page.

`llmcli lens`, `patch` and `attribute` write `<run>/lens/lens.json`, `<run>/patch/patch.json` and
`<run>/attribute/attribution.json`. `run_grids` reads those that exist and turns each into one or
more *grids*: plain JSON objects that the viewer draws with one generic panel (a heat map with
row and column labels, a colour legend and a hover read-out):

    {"id": str, "title": str, "note": str, "source": str, "value": str (what a cell holds),
     "row_title": str, "col_title": str, "rows": [R strs], "cols": [C strs],
     "values": [[C floats or null] x R], "scale": "sequential" | "diverging",
     "domain": [lo, hi] (optional: the data's range, or symmetric about 0 when diverging),
     "cell_notes": [[C strs] x R] (optional: more text for a cell's read-out),
     "row_names": [R strs], "col_names": [C strs] (optional: how the read-out names a row or
         a column; default "<title> <label>"),
     "col_tokens": bool (optional: the column labels are tokens: "<title> <index> “label”")}

The files are read defensively: a file that is not a JSON object is skipped whole, a grid whose
values are missing or do not have the shape its labels give is skipped alone, each with one
`notify` line; optional parts (labels, prompts, notes) are shown where present.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmcli.fileio import JSONFileError, read_json

log = logging.getLogger(__name__)

#: Where each command writes its result, relative to the run directory.
RESULT_FILES = {
    "lens": Path("lens") / "lens.json",
    "patch": Path("patch") / "patch.json",
    "attribute": Path("attribute") / "attribution.json",
}
#: The patching grids, in the order the page shows them: key -> (what a row is, a column is).
PATCH_GRIDS = {
    "resid_pre": "residual stream before each block",
    "attn_out": "attention output",
    "mlp_out": "MLP output",
    "head_out": "each head's output, all positions",
}


class Malformed(ValueError):
    """A result file, or one grid in it, that cannot be shown (the message says why)."""


# --------------------------------------------------------------------------------------------
# Checking what a file holds.
# --------------------------------------------------------------------------------------------


def _number(v: Any) -> float | None:
    """A finite number kept to 6 significant digits (the page shows 4), anything else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(f"{v:.6g}")


def _matrix(data: dict[str, Any], key: str, n_rows: int | None = None) -> list[list[float | None]]:
    """`data[key]` as a rectangular list of rows of numbers (non-finite ones None).

    Raises:
        Malformed: missing, not a non-empty list of equal-length lists of numbers, or not
            `n_rows` rows.
    """
    rows = data.get(key)
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
        raise Malformed(f'"{key}" is missing or not a list of rows')
    width = len(rows[0])
    if width == 0 or any(len(r) != width for r in rows):
        raise Malformed(f'"{key}" has rows of different lengths (or empty ones)')
    if n_rows is not None and len(rows) != n_rows:
        raise Malformed(f'"{key}" has {len(rows)} rows, expected {n_rows}')
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for r in rows for v in r):
        raise Malformed(f'"{key}" holds something other than numbers')
    return [[_number(v) for v in r] for r in rows]


def _strings(data: dict[str, Any], key: str, n: int | None = None) -> list[str] | None:
    """`data[key]` if it is a list of `n` strings (any length where `n` is None), else None."""
    value = data.get(key)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        return None
    return value if n is None or len(value) == n else None


def _text(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    return value if isinstance(value, str) else None


def _fmt(v: Any) -> str:
    n = _number(v)
    return "n/a" if n is None else f"{n:+.4f}"


def _answer_note(data: dict[str, Any]) -> list[str]:
    """The metric's parts, where present: answer, wrong answer, metric name."""
    parts = []
    for key in ("answer", "wrong"):
        if _text(data, key) is not None:
            parts.append(f"{key} {json.dumps(data[key], ensure_ascii=False)}")
    if _text(data, "metric"):
        parts.append(f"metric {data['metric']}")
    return parts


# --------------------------------------------------------------------------------------------
# One builder per result file: the parsed JSON object in, its grids out.
# --------------------------------------------------------------------------------------------


def _quoted(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _lens_notes(data: dict[str, Any], n_rows: int, n_cols: int) -> list[list[str]] | None:
    """Each lens cell's read-out text: the next token, the top token there, the row's loss
    (each where the file has it). A row of `top_tokens` may also hold the top token after the
    last position (T entries instead of T-1): that one has no cell."""
    tokens = _strings(data, "tokens", n_cols + 1)
    top = data.get("top_tokens")
    if not (isinstance(top, list) and len(top) == n_rows):
        top = None
    elif not all(
        _strings({"row": row}, "row", n_cols) or _strings({"row": row}, "row", n_cols + 1)
        for row in top
    ):
        top = None
    loss = data.get("loss")
    if not (isinstance(loss, list) and len(loss) == n_rows):
        loss = None
    if tokens is None and top is None and loss is None:
        return None
    notes = []
    for i in range(n_rows):
        row = []
        for t in range(n_cols):
            parts = [f"next {_quoted(tokens[t + 1])}"] if tokens is not None else []
            parts += [f"top {_quoted(top[i][t])}"] if top is not None else []
            if loss is not None and _number(loss[i]) is not None:
                parts.append(f"row's mean loss {_number(loss[i]):.4f}")
            row.append(", ".join(parts))
        notes.append(row)
    return notes


def lens_grids(data: dict[str, Any], source: str = "lens/lens.json") -> list[dict[str, Any]]:
    """The logit lens: boundary x position, the log-prob of the next token read there.

    Raises:
        Malformed: no `logprobs` grid.
    """
    values = _matrix(data, "logprobs")
    n_rows, n_cols = len(values), len(values[0])
    tokens = _strings(data, "tokens", n_cols + 1)
    prompt = _text(data, "prompt")
    layers = _strings(data, "layers", n_rows) or [str(i) for i in range(n_rows)]
    return [
        {
            "id": "lens",
            "title": "Logit lens: log-prob of the next token, read after each layer",
            "note": "" if prompt is None else f"prompt {_quoted(prompt)}",
            "source": source,
            "value": "log-prob",
            "row_title": "after layer",
            "col_title": "position",
            "rows": layers,
            "row_names": [name if name == "embed" else f"after layer {name}" for name in layers],
            "cols": tokens[:-1] if tokens is not None else [str(t) for t in range(n_cols)],
            "col_tokens": tokens is not None,
            "values": values,
            "scale": "sequential",
            "cell_notes": _lens_notes(data, n_rows, n_cols),
        }
    ]


def patch_grids(
    data: dict[str, Any],
    source: str = "patch/patch.json",
    notify: Callable[[str], Any] = log.warning,
) -> list[dict[str, Any]]:
    """Activation patching: one grid per patched activation present (see `PATCH_GRIDS`),
    layer x position (`head_out`: layer x head), the normalised effect on a diverging scale
    from -1 to 1 (wider where the data go past). A grid that is malformed is left out with a
    `notify` line.

    Raises:
        Malformed: none of the grids is there.
    """
    note = [f"clean {_fmt(data.get('clean'))}, corrupt {_fmt(data.get('corrupt'))}"]
    note += _answer_note(data)
    for key in ("clean_prompt", "corrupt_prompt"):
        if _text(data, key) is not None:
            note.append(f"{key.replace('_', ' ')} {_quoted(data[key])}")
    grids: list[dict[str, Any]] = []
    for key, what in PATCH_GRIDS.items():
        if key not in data:
            continue
        try:
            values = _matrix(data, key)
        except Malformed as exc:
            notify(f"viewer: skipping {key} of {source}: {exc}")
            continue
        n_cols = len(values[0])
        tokens = None if key == "head_out" else _strings(data, "tokens", n_cols)
        cols = tokens or [str(t) for t in range(n_cols)]
        bound = max([1.0] + [abs(v) for row in values for v in row if v is not None])
        grids.append(
            {
                "id": f"patch-{key}",
                "title": f"Activation patching: {key} ({what}), normalised effect",
                "note": "" if grids else "; ".join(note),  # the first grid says it for all
                "source": source,
                "value": "normalised effect",
                "row_title": "layer",
                "col_title": "head" if key == "head_out" else "position",
                "rows": [str(i) for i in range(len(values))],
                "cols": cols,
                "col_tokens": tokens is not None,
                "values": values,
                "scale": "diverging",
                "domain": [-bound, bound],
            }
        )
    if not grids:
        raise Malformed(f"none of {', '.join(PATCH_GRIDS)} is there")
    return grids


def attribution_grids(
    data: dict[str, Any], source: str = "attribute/attribution.json"
) -> list[dict[str, Any]]:
    """Direct logit attribution: layer x (each head, then the MLP), on a diverging scale
    symmetric about 0; the embedding, the rest and the total go in the note.

    Raises:
        Malformed: no `heads` grid, or an `mlp` list that does not have one number per layer.
    """
    heads = _matrix(data, "heads")
    n_layer, n_head = len(heads), len(heads[0])
    cols = [str(h) for h in range(n_head)]
    values = [list(row) for row in heads]
    if "mlp" in data:
        mlp = _matrix({"mlp": [data["mlp"]]}, "mlp")[0]
        if len(mlp) != n_layer:
            raise Malformed(f'"mlp" has {len(mlp)} numbers for {n_layer} layers')
        cols.append("MLP")
        values = [row + [m] for row, m in zip(values, mlp, strict=True)]
    note = [f"logit difference {_fmt(data.get('logit_diff'))}"]
    note += [f"{key} {_fmt(data[key])}" for key in ("embed", "rest") if key in data]
    note += _answer_note(data)
    if _text(data, "prompt") is not None:
        note.append(f"prompt {_quoted(data['prompt'])}")
    bound = max([abs(v) for row in values for v in row if v is not None] + [1e-6])
    return [
        {
            "id": "attribution",
            "title": "Direct logit attribution: each head's and MLP's part of the logit difference",
            "note": "; ".join(note),
            "source": source,
            "value": "direct effect on the logit difference",
            "row_title": "layer",
            "col_title": "head",
            "rows": [str(i) for i in range(n_layer)],
            "cols": cols,
            "col_names": [f"head {c}" if c != "MLP" else "MLP" for c in cols],
            "values": values,
            "scale": "diverging",
            "domain": [-bound, bound],
        }
    ]


# --------------------------------------------------------------------------------------------
# The run folder.
# --------------------------------------------------------------------------------------------


def _read_object(path: Path) -> dict[str, Any]:
    try:
        data = read_json(path)
    except JSONFileError as exc:
        raise Malformed(f"not readable as JSON ({exc.cause})") from None
    if not isinstance(data, dict):
        raise Malformed("not a JSON object")
    return data


def run_grids(
    run_dir: str | Path | None, notify: Callable[[str], Any] = log.warning
) -> list[dict[str, Any]]:
    """The grids of every result file in `run_dir` (see the module doc), lens first, then
    patching, then attribution; [] where there are none (or `run_dir` is None). A file that
    cannot be shown is skipped with one `notify` line naming it and why."""
    if run_dir is None:
        return []
    grids: list[dict[str, Any]] = []
    for kind, rel in RESULT_FILES.items():
        path = Path(run_dir) / rel
        if not path.is_file():
            continue
        source = rel.as_posix()
        try:
            data = _read_object(path)
            if kind == "lens":
                grids += lens_grids(data, source)
            elif kind == "patch":
                grids += patch_grids(data, source, notify)
            else:
                grids += attribution_grids(data, source)
        except Malformed as exc:
            notify(f"viewer: skipping {path}: {exc}")
    return grids
