"""The offline viewer: one self-contained HTML page per dump, with the run's other grids.

`write_viewer` fills the template `llmcli/inspection/viewer.html` (plain HTML, CSS and JavaScript,
no network, no CDN) with a dump's data inlined as JSON: every head of a layer (or of every layer)
side by side as small multiples; one head (or the mean of the heads) large, its query and key
tokens on the axes, a colour legend; hover or click a token or a cell to see where that query
attends. Below it, the run's lens, patching and attribution results (`grids.run_grids`), each a
heat map with labelled axes, a legend and a hover read-out.

`write_run_page` writes one page from a run folder; `refresh_run_pages` rewrites the run's pages
after `llmcli lens`, `patch` or `attribute` has written a new result.

The weights travel as base64 little-endian float32, lower triangle only (row q holds keys 0..q;
everything above the diagonal is 0 in a causal map), which halves the file and keeps full
precision for the hover read-out.
"""

from __future__ import annotations

import base64
import json
import logging
import math
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from llmcli.fileio import atomic_write_text, newest
from llmcli.inspection.dump import FORMATS, AttentionDump, load_dump
from llmcli.inspection.grids import run_grids

log = logging.getLogger(__name__)

_ATTENTION = "__ATTENTION_DATA__"
_GRIDS = "__GRID_DATA__"
#: The page's name, in `<run>/attention/` (and in each `prompt-NNN/` inside it).
PAGE = "attention.html"


def _lower_triangle(attn: np.ndarray) -> np.ndarray:
    """`[L, H, T, T]` -> `[L, H, T*(T+1)/2]`: each row q's keys 0..q, rows in order."""
    T = attn.shape[-1]
    rows, cols = np.tril_indices(T)  # row-major: (0,0), (1,0), (1,1), (2,0), ...
    return attn[..., rows, cols]


def viewer_data(dump: AttentionDump) -> dict[str, Any]:
    """The JSON object the page reads (also handy for tests)."""
    tri = _lower_triangle(np.asarray(dump.attn, dtype="<f4"))  # (L', H', T*(T+1)/2)
    metrics = [
        [[None if math.isnan(v) else v for v in head] for head in layer]
        for layer in np.asarray(dump.metrics, dtype=np.float64).tolist()
    ]
    meta = dump.meta or {}
    return {
        "tokens": list(dump.tokens),
        "token_ids": [int(i) for i in dump.token_ids],
        "layers": [int(i) for i in dump.layers],
        "heads": [int(i) for i in dump.heads],
        "metric_names": list(dump.metric_names),
        "metrics": metrics,
        "attn_b64": base64.b64encode(np.ascontiguousarray(tri, dtype="<f4").tobytes()).decode(),
        "meta": {k: meta[k] for k in ("checkpoint", "prompt", "weights_sha256") if k in meta},
    }


def script_json(obj: Any) -> str:
    """`obj` as JSON that is safe inside a <script> element."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    # Inside <script> the sequence "</script>" (in a token, say) would end the element early:
    # escape the characters HTML cares about; JSON.parse reads the escapes back unchanged.
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_viewer(dump: AttentionDump | None, grids: Sequence[dict[str, Any]] = ()) -> str:
    """The viewer page as one HTML string with the data inlined: `dump`'s attention (None: no
    attention section) and `grids` (see `grids.run_grids`)."""
    template = (
        resources.files("llmcli.inspection").joinpath("viewer.html").read_text(encoding="utf-8")
    )
    attention = None if dump is None else viewer_data(dump)
    page = template.replace(_ATTENTION, script_json(attention), 1)
    return page.replace(_GRIDS, script_json(list(grids)), 1)


def write_viewer(
    dump: AttentionDump | None, path: str | Path, grids: Sequence[dict[str, Any]] = ()
) -> Path:
    """Write the viewer page for `dump` and `grids` to `path` (atomically); returns the path."""
    path = Path(path)
    html = render_viewer(dump, grids)
    path.parent.mkdir(parents=True, exist_ok=True)  # callers may name a new folder
    atomic_write_text(path, html)
    return path


def dump_beside(page: str | Path) -> Path | None:
    """The attention dump written with a page (`attention.npz`, `.safetensors` or `.json` in
    its folder; the newest if several), or None."""
    folder = Path(page).parent
    return newest(folder / f"attention{suffix}" for suffix in FORMATS.values())


def write_run_page(
    run_dir: str | Path,
    out_path: str | Path | None = None,
    dump: AttentionDump | None = None,
    notify: Callable[[str], Any] = log.warning,
) -> Path:
    """Write one viewer page with `dump` and the grids of the run's result files now.

    Args:
        run_dir: the run folder (its `lens/`, `patch/`, `attribute/` results are read).
        out_path: the page (None: `<run>/attention/attention.html`).
        dump: the attention to show; None: the dump beside `out_path` (see `dump_beside`), or
            no attention section where there is none or it cannot be read (with a `notify`
            line).
        notify: receives one line per result file or dump skipped.

    Returns:
        The page's path.
    """
    path = Path(out_path) if out_path is not None else Path(run_dir) / "attention" / PAGE
    if dump is None and (found := dump_beside(path)) is not None:
        try:
            dump = load_dump(found)
        except Exception as exc:  # a damaged file fails in its reader's own way: show the rest
            notify(f"viewer: cannot read the attention dump {found} ({exc}); page without it")
    return write_viewer(dump, path, run_grids(run_dir, notify))


def refresh_run_pages(
    run_dir: str | Path, notify: Callable[[str], Any] = log.warning
) -> list[Path]:
    """Rewrite the run's viewer pages with its result files as they are now (for `llmcli lens`,
    `patch` and `attribute`, after they write theirs).

    The pages are `<run>/attention/attention.html` and `<run>/attention/prompt-*/attention.html`
    (where `inspect-attention` writes them), each with the dump beside it; with none there yet,
    `<run>/attention/attention.html` is written with the grids alone.

    Returns:
        The pages written.
    """
    folder = Path(run_dir) / "attention"
    pages = [p for p in [folder / PAGE, *sorted(folder.glob(f"prompt-*/{PAGE}"))] if p.is_file()]
    return [write_run_page(run_dir, page, notify=notify) for page in pages or [folder / PAGE]]
