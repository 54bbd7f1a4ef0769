"""The report of `llmcli bench`: a text table, `bench.json` and `bench.png` of measured results.

`write_report` saves the results (`llmcli.bench.measure`'s `BenchResult`s) as `bench.json`, with
where they were measured (`machine_info`), and a `bench.png` of each measure against the
sequence length, one line per head count; `bench_and_report` is what `llmcli bench` runs.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from llmcli.bench.measure import BenchResult, BenchSettings, run_bench
from llmcli.config import Config
from llmcli.device import resolve_device, usable_cpus
from llmcli.errors import InputError, describe_os_error
from llmcli.fileio import atomic_write_json, write_figure

JSON_FILE = "bench.json"
PLOT_FILE = "bench.png"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: Sequence[BenchResult]) -> str:
    """The results as an aligned text table (invalid and failed combinations say why)."""
    header = (
        "heads",
        "seq",
        "head_size",
        "train tok/s",
        "sample tok/s",
        "fwd ms (1xT)",
        "peak MB",
        "growth MB",
    )
    rows = []
    notes: dict[tuple[int, str, str], list[int]] = {}  # (heads, status, why) -> lengths
    for r in results:
        if r.status != "ok":
            rows.append((str(r.n_head), str(r.context_length), "-", r.status, "-", "-", "-", "-"))
            notes.setdefault((r.n_head, r.status, r.message), []).append(r.context_length)
            continue
        rows.append(
            (
                str(r.n_head),
                str(r.context_length),
                str(r.head_size),
                _fmt(r.train_tokens_per_s, ",.0f"),
                _fmt(r.sample_tokens_per_s, ",.1f"),
                _fmt(r.forward_ms, ".2f"),
                _fmt(r.peak_memory_mb, ",.0f"),
                _fmt(r.memory_growth_mb, ",.0f"),
            )
        )
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [
        "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
        for row in (header, *rows)
    ]
    for (n_head, status, why), lengths in notes.items():
        lines.append(f"heads={n_head} (seq {', '.join(map(str, lengths))}) {status}: {why}")
    return "\n".join(lines)


def machine_info(device: str) -> dict[str, Any]:
    """Where the figures were measured (for the JSON report)."""
    info: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": usable_cpus(),  # the CPUs the figures could use, not the host's
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    if hasattr(os, "getloadavg"):
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_report(
    results: Sequence[BenchResult],
    out_dir: str | Path,
    meta: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write `bench.json` (meta + results) and `bench.png` into `out_dir` (atomically).

    Returns:
        `(json_path, png_path)`.
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        json_path, png_path = out / JSON_FILE, out / PLOT_FILE
        atomic_write_json(json_path, {**(meta or {}), "results": [r.to_dict() for r in results]})
        write_figure(png_path, bench_figure(results))
    except OSError as exc:
        raise InputError(
            f"cannot write the bench report into '{out}': {describe_os_error(exc)}."
        ) from None
    return json_path, png_path


PANELS = (
    ("train_tokens_per_s", "training tokens/s"),
    ("sample_tokens_per_s", "sampling tokens/s (KV cache, batch 1)"),
    ("forward_ms", "forward latency, ms (1 x T)"),
    ("peak_memory_mb", "peak memory, MB"),
)


def bench_figure(results: Sequence[BenchResult]) -> Figure:
    """A 2 x 2 figure: each measure against the sequence length, one line per head count."""
    ok = [r for r in results if r.status == "ok"]
    fig = Figure(figsize=(10, 7), dpi=100)
    FigureCanvasAgg(fig)
    for i, (key, title) in enumerate(PANELS):
        ax = fig.add_subplot(2, 2, i + 1)
        for n_head in sorted({r.n_head for r in ok}):
            points = sorted(
                (r.context_length, getattr(r, key))
                for r in ok
                if r.n_head == n_head and getattr(r, key) is not None
            )
            if points:
                label = f"{n_head} head" + ("s" if n_head != 1 else "")
                ax.plot(*zip(*points, strict=True), "o-", ms=4, label=label)
        ax.set_xscale("log", base=2)
        lengths = sorted({r.context_length for r in ok})
        ax.set_xticks(lengths, [str(t) for t in lengths])
        ax.minorticks_off()
        ax.set_xlabel("sequence length (context_length)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(
                0.5,
                0.5,
                "not measured",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
    fig.tight_layout()
    return fig


def bench_and_report(
    config: Config,
    heads: Sequence[int] | None,
    seqs: Sequence[int] | None,
    device: str | None,
    out_dir: str | Path | None,
    settings: BenchSettings | None = None,
    *,
    isolate: bool = True,
    progress: bool = True,
) -> tuple[list[BenchResult], Path, Path]:
    """What `llmcli bench` runs: measure, then write the report.

    The report goes to `out_dir`, default `checkpoints/bench/<config name>` (git-ignored, and
    never mistaken for a run: it holds no weights).

    Returns:
        `(results, json_path, png_path)`.
    """
    settings = settings or BenchSettings()
    device = device or config.train.device
    if config.train.batch_size == "auto":
        raise InputError(
            "llmcli bench measures at a given micro-batch: set one with --set "
            "train.batch_size=N (`llmcli plan` says which one auto would choose)."
        )
    results = run_bench(config, heads, seqs, device, settings, isolate=isolate, progress=progress)
    out = Path(out_dir) if out_dir is not None else Path("checkpoints") / "bench" / config.name
    meta = {
        "benchmark": "llmcli bench",
        "config": config.to_dict(),
        "settings": dataclasses.asdict(settings),
        "isolated": isolate,
        "machine": machine_info(str(resolve_device(device))),
    }
    json_path, png_path = write_report(results, out, meta)
    return results, json_path, png_path
