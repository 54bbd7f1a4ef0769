"""The offline attention viewer: one self-contained HTML file per dump.

`write_viewer` fills the template `llmcli/inspection/viewer.html` (plain HTML, CSS and JavaScript,
no network, no CDN) with a dump's data inlined as JSON: pick a layer and a head (or the mean of
the heads), see the heatmap, hover or click a token or a cell to see where that query attends.

The weights travel as base64 little-endian float32, lower triangle only (row q holds keys 0..q;
everything above the diagonal is 0 in a causal map), which halves the file and keeps full
precision for the hover read-out.
"""

from __future__ import annotations

import base64
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from llmcli.fileio import atomic_write_text
from llmcli.inspection.dump import AttentionDump

_PLACEHOLDER = "__ATTENTION_DATA__"


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


def render_viewer(dump: AttentionDump) -> str:
    """The viewer page for `dump` as one HTML string with the data inlined."""
    template = (
        resources.files("llmcli.inspection").joinpath("viewer.html").read_text(encoding="utf-8")
    )
    payload = json.dumps(viewer_data(dump), ensure_ascii=False, allow_nan=False)
    # Inside <script> the sequence "</script>" (in a token, say) would end the element early:
    # escape the characters HTML cares about; JSON.parse reads the escapes back unchanged.
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return template.replace(_PLACEHOLDER, payload, 1)


def write_viewer(dump: AttentionDump, path: str | Path) -> Path:
    """Write the viewer page for `dump` to `path` (atomically); returns the path."""
    path = Path(path)
    html = render_viewer(dump)
    path.parent.mkdir(parents=True, exist_ok=True)  # callers may name a new folder
    atomic_write_text(path, html)
    return path
