"""Pictures: of a dump, one PNG per layer (a heatmap per head plus the mean over the heads); of
head ablation, a layer x head heat map; and labelled grids (`Grid`, `plot_grids`) for the logit
lens, activation patching and attribution."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from llmcli.fileio import write_figure
from llmcli.inspection.dump import AttentionDump


def token_label(text: str) -> str:
    """A token's text made visible on one line: spaces as '␣', newlines as '↵', tabs as '⇥'."""
    if text == "":
        return "∅"
    return text.replace(" ", "␣").replace("\n", "↵").replace("\r", "␍").replace("\t", "⇥")


def _short_label(text: str, limit: int = 10) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def label_step(T: int, max_labels: int = 32) -> int:
    """Label every `step`-th token so that at most `max_labels` labels sit on an axis."""
    return max(1, math.ceil(T / max_labels))


def plot_layers(dump: AttentionDump, out_dir: str | Path) -> list[Path]:
    """One PNG per layer: a heatmap per head plus the mean over the dump's heads.

    Each panel is labelled with the tokens (every `label_step`-th one for long prompts) and
    grows with the prompt, so maps up to the context length stay readable.

    Returns:
        The written paths, `layer-<L>.png` for each layer in the dump.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)  # callers may name a new folder
    T = len(dump.tokens)
    labels = [_short_label(token_label(t)) for t in dump.tokens]
    step = label_step(T)
    ticks = list(range(0, T, step))
    panel = min(7.0, max(3.0, 1.5 + 0.06 * T))  # inches per heatmap: 5.3 for 64 tokens
    font = 7 if T <= 64 else 6
    n_panels = len(dump.heads) + 1
    ncols = math.ceil(math.sqrt(n_panels))
    nrows = math.ceil(n_panels / ncols)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    future = np.triu(np.ones((T, T), dtype=bool), k=1)  # (T, T): keys after the query
    paths = []
    for li, layer in enumerate(dump.layers):
        # A bare Figure on the Agg canvas: no pyplot, so no GUI backend and no global figure list.
        fig = Figure(figsize=(panel * ncols + 1.2, panel * nrows + 0.8))
        FigureCanvasAgg(fig)
        axes = fig.subplots(
            nrows, ncols, squeeze=False, gridspec_kw={"wspace": 0.25, "hspace": 0.3}
        )
        maps = [dump.attn[li, hi] for hi in range(len(dump.heads))]
        maps.append(dump.attn[li].mean(axis=0))  # (H', T, T) -> (T, T)
        heads_txt = ",".join(str(h) for h in dump.heads)
        titles = [f"head {h}" for h in dump.heads] + [f"mean of heads {heads_txt}"]
        for k, ax in enumerate(axes.flat):
            if k >= n_panels:
                ax.axis("off")
                continue
            # Keys after the query are masked (blank), not drawn as weight 0.
            shown = np.ma.masked_array(maps[k], mask=future)
            im = ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_title(titles[k], fontsize=9)
            ax.set_xticks(ticks, [labels[i] for i in ticks], rotation=90, fontsize=font)
            ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=font)
            if k % ncols == 0:
                ax.set_ylabel("query", fontsize=8)
            if k >= n_panels - ncols:
                ax.set_xlabel("key", fontsize=8)
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6, label="attention weight")
        fig.suptitle(f"layer {layer} ({T} tokens)", fontsize=11)
        path = out_dir / f"layer-{layer}.png"
        write_figure(path, fig, dpi=100, bbox_inches="tight")
        paths.append(path)
    return paths


def plot_head_deltas(delta: dict[str, np.ndarray], path: str | Path, title: str = "") -> Path:
    """A heat map of each head's Δloss, `n_layer` rows x `n_head` columns, one panel per method.

    Each cell is labelled with its value; the colour scale is shared by the panels and centred
    on 0, so heads whose removal lowers the loss show in the other colour.

    Args:
        delta: method -> `(L, H)` Δloss in nats per token (`ablation.HeadDeltas.delta`).
        path: the PNG to write.
        title: the figure's title.

    Returns:
        `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # callers may name a new folder
    maps = {method: np.asarray(d, dtype=np.float64) for method, d in delta.items()}
    n_layer, n_head = next(iter(maps.values())).shape
    top = max(max(float(np.abs(d).max()) for d in maps.values()), 1e-9)
    cell = 0.45 if n_layer * n_head > 144 else 0.8  # inches per head
    fig = Figure(figsize=(len(maps) * (cell * n_head + 1.6), cell * n_layer + 1.4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(maps), squeeze=False)[0]
    for ax, (method, d) in zip(axes, maps.items(), strict=True):
        im = ax.imshow(d, cmap="RdBu_r", vmin=-top, vmax=top, interpolation="nearest")
        ax.set_title(f"{method} ablation", fontsize=9)
        ax.set_xticks(range(n_head), [str(h) for h in range(n_head)], fontsize=7)
        ax.set_yticks(range(n_layer), [str(layer) for layer in range(n_layer)], fontsize=7)
        ax.set_xlabel("head", fontsize=8)
        ax.set_ylabel("layer", fontsize=8)
        if n_layer * n_head <= 144:  # room for a label in every cell
            for (i, j), v in np.ndenumerate(d):
                colour = "white" if abs(v) > 0.6 * top else "black"
                ax.text(j, i, f"{v:.3f}", ha="center", va="center", fontsize=6, color=colour)
    fig.colorbar(im, ax=list(axes), shrink=0.8, label="Δloss (nats/token)")
    fig.suptitle(title or "loss increase when one head is removed", fontsize=10)
    write_figure(path, fig, dpi=100, bbox_inches="tight")
    return path


@dataclass
class Grid:
    """One panel of `plot_grids`: a matrix of values with a label for every row and column.

    Attributes:
        values: `(R, K)`.
        rows, cols: `R` and `K` labels (token texts are made visible with `token_label`).
        title, xlabel, ylabel: the panel's texts.
        top_cols: `K` more column labels, drawn above the panel (e.g. each position's next token).
    """

    values: np.ndarray
    rows: Sequence[str]
    cols: Sequence[str]
    title: str = ""
    xlabel: str = ""
    ylabel: str = ""
    top_cols: Sequence[str] | None = None


def _tick_labels(labels: Sequence[str]) -> tuple[list[int], list[str], int]:
    """(ticks, their labels, rotation): every `label_step`-th label, upright when all are short."""
    shown = [_short_label(token_label(t)) for t in labels]
    ticks = list(range(0, len(shown), label_step(len(shown))))
    rotation = 0 if all(len(t) <= 3 for t in shown) else 90
    return ticks, [shown[i] for i in ticks], rotation


def _draw_grid(ax, grid: Grid, cmap: str, vmin: float, vmax: float):
    values = np.asarray(grid.values, dtype=np.float64)
    im = ax.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    ticks, labels, rotation = _tick_labels(grid.cols)
    ax.set_xticks(ticks, labels, rotation=rotation, fontsize=7)
    ax.set_yticks(range(len(grid.rows)), [str(r) for r in grid.rows], fontsize=7)
    ax.set_title(grid.title, fontsize=9)
    ax.set_xlabel(grid.xlabel, fontsize=8)
    ax.set_ylabel(grid.ylabel, fontsize=8)
    if grid.top_cols is not None:
        ticks, labels, rotation = _tick_labels(grid.top_cols)
        top = ax.secondary_xaxis("top")
        top.set_xticks(ticks, labels, rotation=rotation, fontsize=7)
    if values.size <= 128 and values.shape[1] <= 16:  # room for a label in every cell
        for (i, j), v in np.ndenumerate(values):
            bright = abs(v - (vmin + vmax) / 2) > 0.3 * (vmax - vmin)
            ax.text(
                j,
                i,
                f"{v:.2f}",
                ha="center",
                va="center",
                fontsize=6,
                color="white" if bright else "black",
            )
    return im


def plot_grids(
    grids: Sequence[Grid],
    path: str | Path,
    *,
    title: str = "",
    colour_label: str = "",
    centre: float | None = 0.0,
) -> Path:
    """Labelled heat maps, one panel per grid stacked top to bottom, on one colour scale.

    Args:
        grids: the panels.
        path: the PNG to write.
        title: the figure's title.
        colour_label: what the colour bar measures.
        centre: a diverging scale centred on this value (red above, blue below); None for a
            sequential scale from the smallest value to the largest.

    Returns:
        `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # callers may name a new folder
    finite = [np.asarray(g.values, dtype=np.float64) for g in grids]
    finite = np.concatenate([v[np.isfinite(v)] for v in finite] + [np.zeros(0)])
    if centre is None:
        cmap = "viridis"
        vmin = float(finite.min()) if finite.size else 0.0
        vmax = max(float(finite.max()) if finite.size else 1.0, vmin + 1e-9)
    else:
        cmap = "RdBu_r"
        reach = max(float(np.abs(finite - centre).max()) if finite.size else 1.0, 1e-9)
        vmin, vmax = centre - reach, centre + reach
    cell = 0.28  # inches per cell
    widest = max(len(g.cols) for g in grids)
    heights = [len(g.rows) * cell + 0.9 + (0.3 if g.top_cols is not None else 0) for g in grids]
    longest_title = max(len(line) for line in title.splitlines()) if title else 0
    width = max(widest * cell + 1.4, 3.5, 0.075 * longest_title - 1.0)  # the title fits
    fig = Figure(figsize=(width + 1.2, sum(heights) + 0.4), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subfigures(1, 2, width_ratios=[width, 1.2])
    panels = left.subfigures(len(grids), 1, height_ratios=heights, squeeze=False)[:, 0]
    for panel, grid in zip(panels, grids, strict=True):
        # A narrow grid (layer x head) keeps the cell size and sits on the left.
        spare = widest - len(grid.cols)
        if spare:
            ax, blank = panel.subplots(1, 2, width_ratios=[len(grid.cols), spare])
            blank.axis("off")
        else:
            ax = panel.subplots()
        im = _draw_grid(ax, grid, cmap, vmin, vmax)
    height = min(0.6, 3.0 / (sum(heights) + 0.4))
    cax = right.add_axes((0.15, 0.5 - height / 2, 0.12, height))
    fig.colorbar(im, cax=cax, label=colour_label)
    if title:
        fig.suptitle(title, fontsize=10)
    write_figure(path, fig, dpi=100)  # constrained layout: nothing to trim
    return path
