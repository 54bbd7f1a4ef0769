"""Activation patching: which activations carry the answer from a clean prompt to a corrupted one.

Run the clean prompt and record its activations; run the corrupted prompt (same length) with one
clean activation put in its place, and see how much of the clean answer comes back. The
normalised effect `(patched - corrupt) / (clean - corrupt)` is 1 where the patched activation
alone restores the clean metric, 0 where it changes nothing (Meng et al. 2022, "Locating and
Editing Factual Associations"; Heimersheim & Nanda 2024, "How to use and interpret activation
patching"). The metric is `AnswerMetric`'s, at the last position.

Four grids, as TransformerLens's `patching` module computes them: the residual stream into each
block at each position (`resid_pre`, L x T), each head's output at every position at once (its
slice of `attn.z`, `head_out`, L x H), and the attention and MLP outputs at each position
(`attn_out`, `mlp_out`, L x T).

Patching runs in batches: `Sites` stacks the corrupted prompt once per patched place, and one
hook per hook point puts the clean activation into each row at that row's place (a boolean mask
per row), so a layer's row of a grid takes one forward (or a few, as memory allows) instead of
one per cell. A patch in block l changes nothing below it, so those forwards start from the
corrupted prompt's residual stream into block l (as `ablation.head_deltas` does).

Shapes: `L` layers, `H` heads, `hs` head size, `T` tokens, `C` channels, `k` patched places.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from llmcli.errors import InputError
from llmcli.inspection import answers
from llmcli.inspection.pictures import Grid, plot_grids, token_label
from llmcli.progress import format_fixed

log = logging.getLogger(__name__)

#: Activation memory for the copies of the corrupted prompt run at once.
PATCH_BATCH_BYTES = 256 << 20
#: The grids, in the order they are reported: grid -> the hook point in each block it patches.
GRIDS = {
    "resid_pre": "resid_pre",
    "attn_out": "attn_out",
    "mlp_out": "mlp_out",
    "head_out": "attn.z",
}


@dataclass
class Sites:
    """The places of a patched batch: row `i` takes the clean activation where `masks[name][i]`
    is True, at every hook point named.

    Attributes:
        masks: hook point -> `(k, ...)` bool, broadcastable to the activation there with the batch
            dimension `k` (e.g. `(k, T, 1)` for one position of a `(k, T, C)` stream, or
            `(k, 1, H, 1)` for one head of a `(k, T, H, hs)` `attn.z`).
        start: the first block any of the points is in: the blocks below it compute what the
            corrupted prompt alone gives, so the rows run from the stream into this block.
    """

    masks: dict[str, Tensor] = field(default_factory=dict)
    start: int = 0

    @property
    def rows(self) -> int:
        return next(iter(self.masks.values())).shape[0]


def position_sites(point: str, layer: int, T: int) -> Sites:
    """Block `layer`'s `point` (`resid_pre`, `attn_out`, `mlp_out`): row t patches position t."""
    mask = torch.eye(T, dtype=torch.bool)[..., None]  # (T rows, T positions, 1)
    return Sites({f"blocks.{layer}.{point}": mask}, start=layer)


def head_sites(layer: int, n_head: int) -> Sites:
    """Block `layer`'s heads (each one's slice of `attn.z`, at every position): row h patches
    head h."""
    mask = torch.eye(n_head, dtype=torch.bool)[:, None, :, None]  # (H rows, 1, H heads, 1)
    return Sites({f"blocks.{layer}.attn.z": mask}, start=layer)


def grid_sites(grid: str, layer: int, model: torch.nn.Module, T: int) -> Sites:
    """One layer's row of one of `GRIDS`."""
    if grid == "head_out":
        return head_sites(layer, model.n_head)
    return position_sites(GRIDS[grid], layer, T)


def rows_per_pass(model: torch.nn.Module, T: int, budget: int = PATCH_BATCH_BYTES) -> int:
    """How many copies of a `T`-token prompt to run at once: as many as fit `budget` bytes, a
    copy holding its largest activations (the MLP's `(T, 4C)`) a few at a time."""
    itemsize = next(model.parameters()).element_size()
    return int(max(1, budget // (T * 8 * model.n_embed * itemsize)))


def _put(act: Tensor, mask: Tensor, clean: Tensor) -> Tensor:
    return torch.where(mask, clean, act)  # (k, ...): clean where the row's mask says


@torch.no_grad()
def patched_metrics(
    model: torch.nn.Module,
    stream: Tensor,
    clean_acts: dict[str, Tensor],
    sites: Sites,
    metric: answers.AnswerMetric,
    rows: int | None = None,
) -> Tensor:
    """The metric of the corrupted prompt with each row's clean activations put in.

    Args:
        model: a `Transformer` in eval mode.
        stream: `(1, T, C)` the corrupted prompt's residual stream into block `sites.start`.
        clean_acts: hook point -> the clean prompt's activation there, `(1, ...)`.
        sites: where each row patches (every name must be in `clean_acts`).
        metric: read at the last position.
        rows: copies per forward (default `rows_per_pass`).

    Returns:
        `(k,)` float32, one metric per row of `sites`.
    """
    rows = rows or rows_per_pass(model, stream.shape[1])
    out = []
    for first in range(0, sites.rows, rows):
        chunk = {name: m[first : first + rows].to(stream.device) for name, m in sites.masks.items()}
        k = next(iter(chunk.values())).shape[0]
        hooks = {name: partial(_put, mask=m, clean=clean_acts[name]) for name, m in chunk.items()}
        with model.hooks(hooks):
            x = model.run_blocks(stream.expand(k, -1, -1), start=sites.start)  # (k, T, C)
            out.append(metric(model.to_logits(x[:, -1])))  # (k,)
    return torch.cat(out).float().cpu()


@dataclass
class PatchResult:
    """Activation patching of one clean / corrupted pair.

    Attributes:
        grids: "resid_pre", "attn_out", "mlp_out" `(L, T)` and "head_out" `(L, H)`: the
            normalised effect `(patched - corrupt) / (clean - corrupt)`.
        clean, corrupt: the metric on each prompt as it is.
        tokens, corrupt_tokens: each prompt's `T` tokens, as text.
        metric: what was measured.
        clean_prompt, corrupt_prompt: the texts.
    """

    grids: dict[str, np.ndarray]
    clean: float
    corrupt: float
    tokens: list[str]
    corrupt_tokens: list[str]
    metric: answers.AnswerMetric
    clean_prompt: str = ""
    corrupt_prompt: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            **{name: grid.tolist() for name, grid in self.grids.items()},
            "clean": self.clean,
            "corrupt": self.corrupt,
            "tokens": self.tokens,
            "corrupt_tokens": self.corrupt_tokens,
            **self.metric.to_dict(),
            "clean_prompt": self.clean_prompt,
            "corrupt_prompt": self.corrupt_prompt,
        }


@torch.no_grad()
def patch_grids(
    model: torch.nn.Module,
    clean: Tensor,
    corrupt: Tensor,
    metric: answers.AnswerMetric,
    rows: int | None = None,
) -> tuple[dict[str, np.ndarray], float, float]:
    """Every grid of `GRIDS` for the prompts `clean` and `corrupt`, both `(1, T)`.

    Returns:
        `(grids, clean metric, corrupt metric)`; grids as `PatchResult.grids`, float64.

    Raises:
        InputError: the two prompts give the same metric (there is nothing to restore).
    """
    L = model.n_layer
    names = [f"blocks.{i}.{p}" for i in range(L) for p in GRIDS.values()]
    clean_acts, clean_logits = answers.record(model, clean, names)
    streams, corrupt_logits = answers.record(
        model, corrupt, [f"blocks.{i}.resid_pre" for i in range(L)]
    )
    clean_value = float(metric(clean_logits[:, -1])[0])
    corrupt_value = float(metric(corrupt_logits[:, -1])[0])
    gap = clean_value - corrupt_value
    if abs(gap) < 1e-6:
        raise InputError(
            f"the clean and corrupted prompts give the same {metric.describe()} "
            f"({clean_value:.6g}): patching has nothing to restore; choose a corrupted prompt "
            "that changes the answer, or another --answer / --wrong."
        )
    T, grids = clean.shape[1], {}
    for grid in GRIDS:
        values = [
            patched_metrics(
                model,
                streams[f"blocks.{i}.resid_pre"],
                clean_acts,
                grid_sites(grid, i, model, T),
                metric,
                rows,
            )
            for i in range(L)
        ]
        effect = (torch.stack(values).double() - corrupt_value) / gap  # (L, T) or (L, H)
        grids[grid] = effect.numpy()
    return grids, clean_value, corrupt_value


def plot_patch(result: PatchResult, path: str | Path) -> Path:
    """The four grids in one picture, on one colour scale centred on 0: position grids with
    the clean tokens below and the corrupted ones above."""
    L = result.grids["head_out"].shape[0]
    layers = [str(i) for i in range(L)]
    panels = []
    for name, grid in result.grids.items():
        if name == "head_out":
            heads = [str(h) for h in range(grid.shape[1])]
            panels.append(Grid(grid, layers, heads, "head_out", "head", "layer"))
        else:
            xlabel = "position (clean token below, corrupted above)"
            panels.append(
                Grid(grid, layers, result.tokens, name, xlabel, "layer", result.corrupt_tokens)
            )
    title = (
        f"activation patching: {result.metric.describe()}, clean {result.clean:.3f}, "
        f"corrupted {result.corrupt:.3f}"
    )
    return plot_grids(
        panels, path, title=title, colour_label="(patched - corrupt) / (clean - corrupt)"
    )


def _top_cells(grid: np.ndarray, cols: list[str], k: int = 3) -> str:
    order = np.argsort(-grid, axis=None)[:k]
    cells = [np.unravel_index(i, grid.shape) for i in order]
    return ", ".join(f"{i}.{cols[c]} {grid[i, c]:+.2f}" for i, c in cells)


def format_patch(result: PatchResult) -> str:
    """What `llmcli patch` prints: the metric on both prompts, the largest effects of each
    position grid and the whole head grid."""
    positions = [f"{t}:{token_label(tok)}" for t, tok in enumerate(result.tokens)]
    lines = [
        f"{result.metric.describe()} at the last position: clean {result.clean:.4f}, "
        f"corrupted {result.corrupt:.4f}",
        "normalised effect (patched - corrupt) / (clean - corrupt), 1 = restores the clean answer",
    ]
    for name in ("resid_pre", "attn_out", "mlp_out"):
        lines.append(
            f"{name:<9} top (layer.position:token): {_top_cells(result.grids[name], positions)}"
        )
    heads = result.grids["head_out"]
    lines.append(
        "head_out  layer " + " ".join(f"{'head ' + str(h):>7}" for h in range(heads.shape[1]))
    )
    for layer, row in enumerate(heads):
        lines.append(f"          {layer:>5} " + " ".join(format_fixed(v, ">7.3f") for v in row))
    return "".join(f"{text}\n" for text in lines)


def run_patch(
    options: answers.RunOptions,
    clean: str,
    corrupt: str,
    metric_texts: tuple[str, str | None],
    *,
    notify: Callable[[str], Any] = log.warning,
) -> tuple[PatchResult, list[Path]]:
    """`llmcli patch`: load the run, patch every grid, write `patch.json` and `patch.png` into
    `options.out_dir` (default `<run>/patch/`).

    Args:
        options: the run and the output folder.
        clean, corrupt: the two prompts, of the same number of tokens.
        metric_texts: `(--answer, --wrong)` texts, one token each (`--wrong` may be None).
        notify: receives the notices (the run used).

    Raises:
        InputError: prompts of different lengths, empty or too long; an answer that is not one
            token; prompts that give the same metric; an unwritable folder.
    """
    run = answers.open_run(options, notify)
    tok, ctx = run.tokenizer, run.model.context_length
    metric = answers.AnswerMetric.from_texts(tok, *metric_texts)
    clean_ids = answers.encode_text(tok, clean, ctx, "--clean")
    corrupt_ids = answers.encode_text(tok, corrupt, ctx, "--corrupt")
    if len(clean_ids) != len(corrupt_ids):
        raise InputError(
            f"--clean is {len(clean_ids)} tokens long and --corrupt {len(corrupt_ids)}: "
            "patching puts each position's activation in the same position of the other, so "
            "give two prompts of the same number of tokens."
        )
    device = answers.model_device(run.model)
    grids, clean_value, corrupt_value = patch_grids(
        run.model,
        torch.tensor([clean_ids], device=device),
        torch.tensor([corrupt_ids], device=device),
        metric,
    )
    result = PatchResult(
        grids,
        clean_value,
        corrupt_value,
        answers.token_texts(tok, clean_ids),
        answers.token_texts(tok, corrupt_ids),
        metric,
        clean,
        corrupt,
    )
    plot = partial(plot_patch, result)
    return result, answers.write_result(
        options, run, "patch", "patch", result.to_dict(), plot, notify
    )
