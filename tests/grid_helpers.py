"""Shared by the viewer tests: a run folder's lens, patching and attribution results, made by hand
with plausible values (2 layers of 3 heads, a 5-token prompt), and reading a page's data back."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

L, H = 2, 3
TOKENS = ["R", "O", " ", "M", "\n"]
T = len(TOKENS)


def lens_result() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    logprobs = -6.0 * rng.random((L + 1, T - 1))  # (L+1, T-1), log-probs
    logprobs[-1, 0] = -0.0123456789  # more digits than the page keeps
    return {
        "prompt": "".join(TOKENS),
        "layers": ["embed", *map(str, range(L))],
        "tokens": TOKENS,
        "logprobs": logprobs.tolist(),
        "top_tokens": [["O", "M", "E", "O"], ["O", " ", "M", "\n"], ["A", "B", "C", "D"]],
        "loss": [4.5, 3.25, 2.125],
    }


def patch_result() -> dict[str, Any]:
    rng = np.random.default_rng(4)
    grids = {key: rng.uniform(-0.3, 1.0, (L, T)) for key in ("resid_pre", "attn_out", "mlp_out")}
    grids["resid_pre"][:, -1] = 1.0  # the last position carries the answer
    return {
        **{key: g.tolist() for key, g in grids.items()},
        "head_out": rng.uniform(-0.2, 0.6, (L, H)).tolist(),
        "clean": 2.5,
        "corrupt": -1.25,
        "clean_prompt": "".join(TOKENS),
        "corrupt_prompt": "RO J\n",
        "tokens": TOKENS,
        "answer": "a",
        "wrong": "o",
    }


def attribution_result() -> dict[str, Any]:
    rng = np.random.default_rng(5)
    heads, mlp = rng.normal(0, 0.5, (L, H)), rng.normal(0, 0.5, L)
    embed, rest = 0.25, -0.0625
    return {
        "logit_diff": float(heads.sum() + mlp.sum() + embed + rest),
        "embed": embed,
        "heads": heads.tolist(),
        "mlp": mlp.tolist(),
        "rest": rest,
        "prompt": "".join(TOKENS),
        "answer": "a",
        "wrong": "o",
        "tokens": TOKENS,
    }


RESULTS = {
    "lens/lens.json": lens_result,
    "patch/patch.json": patch_result,
    "attribute/attribution.json": attribution_result,
}


def write_results(run_dir: Path, **override: Any) -> Path:
    """Write the three result files into `run_dir`; `override` replaces a file's content by
    its kind (`lens=`, `patch=`, `attribute=`): a dict or list is written as JSON, a string or
    bytes as they are, None leaves the file out."""
    kinds = dict(zip(("lens", "patch", "attribute"), RESULTS.items(), strict=True))
    for kind, (rel, make) in kinds.items():
        content = override[kind] if kind in override else make()
        if content is None:
            continue
        path = run_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
    return run_dir


def page_data(html: str) -> tuple[Any, list[dict[str, Any]]]:
    """The attention data (None where the page has none) and the grids inlined in a page."""

    def script(name: str) -> Any:
        pattern = rf'<script type="application/json" id="{name}">(.*?)</script>'
        return json.loads(re.search(pattern, html, re.S).group(1))

    return script("attention-data"), script("grid-data")
