"""`llmcli sae eval`: how well an SAE stands in for the activation it was trained on.

On consecutive windows of the run's validation split (`llmcli.evaluation.text`, as `llmcli eval`
reads it), two passes:

1. the clean forward, with the activation at the hook point read and run through the SAE:
   `explained_variance` = 1 - sum |x - x̂|² / sum |x - mean(x)|² over every token, `l0` (the
   mean number of active features per token), the features that fire on no token scored
   (`dead_fraction`), the mean activation (for pass 2) and the clean loss `ce_clean`;
2. three forwards with the hook point replaced: by the SAE's reconstruction (`ce_sae`, the SAE
   spliced in, `steer.splice`), by zeros (`ce_zero`) and by the mean activation of pass 1
   (`ce_mean`).

`ce_recovered = (ce_zero - ce_sae) / (ce_zero - ce_clean)`: the share of the loss that removing
the activation costs and the SAE gives back (1: as good as the activation itself; SAELens's
`ce_loss_score`); `ce_recovered_mean` is the same against mean ablation, the harder baseline.
Losses are mean cross-entropy in nats per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from llmcli.device import check_threads, resolve_device, torch_threads
from llmcli.errors import CheckpointError, InputError
from llmcli.evaluation.text import eval_tokens, window_batches, window_starts
from llmcli.fileio import newest
from llmcli.inspection.sae.folder import CFG_FILE, LoadedSAE, load_sae
from llmcli.inspection.sae.points import as_rows, check_hook, replacing
from llmcli.inspection.sae.steer import splice
from llmcli.inspection.sae.transcoder_folder import (
    is_transcoder_folder,
    layer_as_sae,
    load_transcoders,
)
from llmcli.progress import Progress
from llmcli.runs.directory import CONFIG_FILE, MODEL_FILE
from llmcli.runs.loading import LoadedRun, find_latest_run, latest_run_notice, load_run

#: Batches scored when `--steps` is not given: about 80K tokens on the tiny run (context 64).
DEFAULT_STEPS = 40
#: Windows per batch when `--batch-size` is not given.
DEFAULT_BATCH = 32


@dataclass(frozen=True)
class ReadOptions:
    """Which SAE and run the readers of an SAE (`sae eval`, `sae features`) load, and how much
    of the validation text they read.

    Attributes:
        sae: the SAE folder (None: the most recently written under `<run>/sae/`).
        checkpoint: the run (None: the SAE's own run when `sae` is given, else the latest run).
        data: a UTF-8 text file to read instead of the run's validation split.
        steps: batches of windows to read (None: `DEFAULT_STEPS`).
        batch_size: windows of context_length tokens per batch (None: `DEFAULT_BATCH`).
        weights, device, threads: as `llmcli eval` takes them.
        layer: for a transcoder folder, the layer whose features are read.
    """

    sae: str | Path | None = None
    checkpoint: str | Path | None = None
    data: str | Path | None = None
    steps: int | None = None
    batch_size: int | None = None
    weights: str = "best"
    device: str = "auto"
    threads: int | None = None
    layer: int | None = None

    def __post_init__(self) -> None:
        check_threads(self.threads)
        for option, value in (("--steps", self.steps), ("--batch-size", self.batch_size)):
            if value is not None and value < 1:
                raise InputError(f"{option} ({value}) must be at least 1.")


def find_sae(run_dir: Path) -> Path:
    """The SAE folder under `<run>/sae/` whose `cfg.json` was written last.

    Raises:
        CheckpointError: none there, saying how to train one.
    """
    cfg = newest((run_dir / "sae").rglob(CFG_FILE))
    if cfg is None:
        raise CheckpointError(
            f"no SAE under '{run_dir / 'sae'}/': train one with `llmcli sae train --hook "
            "blocks.1.resid_post`, or pass --sae DIR."
        )
    return cfg.parent


def run_of(loaded: LoadedSAE) -> Path | None:
    """The run an SAE belongs to: the run folder it sits in (the default `<run>/sae/<hook>/`,
    wherever the run has moved), else the run it was trained on, as recorded."""
    for folder in loaded.folder.parents:
        if (folder / CONFIG_FILE).is_file() and (folder / MODEL_FILE).is_file():
            return folder
    return Path(loaded.info.run) if loaded.info.run else None


def open_sae(
    options: ReadOptions, notify: Callable[[str], Any]
) -> tuple[LoadedSAE, LoadedRun, torch.device]:
    """The SAE and the run that `options` name, both on the device, checked against each other."""
    device = resolve_device(options.device, what="--device")
    checkpoint = options.checkpoint
    if options.sae is not None and is_transcoder_folder(options.sae):
        loaded = layer_as_sae(load_transcoders(options.sae), options.layer)
        if checkpoint is None:
            checkpoint = run_of(loaded)
        run = load_run(checkpoint, weights=options.weights, device=device, notify=notify)
    elif options.sae is not None:
        loaded = load_sae(options.sae)
        if checkpoint is None:
            checkpoint = run_of(loaded)
        run = load_run(checkpoint, weights=options.weights, device=device, notify=notify)
    else:
        if checkpoint is None:
            checkpoint = find_latest_run()
            notify(latest_run_notice(checkpoint))
        run = load_run(checkpoint, weights=options.weights, device=device, notify=notify)
        folder = find_sae(run.run_dir)
        notify(f"using the latest SAE of the run: {folder}")
        loaded = load_sae(folder)
    if check_hook(run.model, loaded.info.hook) != loaded.sae.d_in:
        raise InputError(
            f"the SAE '{loaded.folder}' reads {loaded.sae.d_in} channels at {loaded.info.hook}, "
            f"and run '{run.run_dir}' has another width there: it was trained on another run."
        )
    loaded.sae.to(device)
    return loaded, run, device


@dataclass
class SAEEval:
    """What `evaluate_sae` measured (see the module doc); JSON-ready through `to_dict`."""

    sae: str
    run: str
    hook: str
    features: int
    data: str
    tokens: int
    explained_variance: float
    mse: float
    l0: float
    dead_fraction: float
    ce_clean: float
    ce_sae: float
    ce_zero: float
    ce_mean: float
    ce_recovered: float
    ce_recovered_mean: float
    elapsed_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def loss_sum(logits: Tensor, y: Tensor) -> float:
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()


@torch.no_grad()
def measure(
    loaded: LoadedSAE,
    run: LoadedRun,
    batches: list[tuple[Tensor, Tensor]],
    *,
    progress: bool = False,
) -> dict[str, float]:
    """The figures of the module doc on `batches` of `(x, y)` windows, each `(B, T)`."""
    model, sae, hook = run.model, loaded.sae, loaded.info.hook
    sums = np.zeros(4)  # squared error, sum of |x|², clean nats, active features
    x_sum = torch.zeros(sae.d_in, dtype=torch.float64, device=sae.W_dec.device)
    fired = torch.zeros(sae.d_sae, dtype=torch.bool, device=sae.W_dec.device)
    tokens = 0
    bar = Progress(2 * len(batches), desc="sae eval", unit="batch", enabled=progress, tenths=True)
    for x, y in batches:
        seen: list[Tensor] = []
        with model.hooks({hook: seen.append}):
            logits, _ = model(x)  # (B, T, V)
        rows = as_rows(seen[0]).float()  # (N, d_in)
        acts = sae.encode(rows)  # (N, F)
        sums += [
            (sae.decode(acts) - rows).pow(2).sum().item(),
            rows.pow(2).sum().item(),
            loss_sum(logits, y),
            (acts > 0).sum().item(),
        ]
        x_sum += rows.sum(0).double()
        fired |= (acts > 0).any(0)
        tokens += len(rows)
        bar.update()
    mean = (x_sum / tokens).float()  # (d_in,)
    ablated = {
        "sae": splice(sae),
        "zero": torch.zeros_like,
        "mean": replacing(lambda r: mean.to(r.dtype).expand_as(r)),
    }
    nats = dict.fromkeys(ablated, 0.0)
    for x, y in batches:
        for name, fn in ablated.items():
            with model.hooks({hook: fn}):
                nats[name] += loss_sum(model(x)[0], y)
        bar.update()
    bar.close()
    sq_err, sq_x, clean, active = sums
    total_var = sq_x - tokens * mean.double().pow(2).sum().item()
    ce = {name: value / tokens for name, value in nats.items()}
    ce_clean = clean / tokens
    return {
        "tokens": tokens,
        "explained_variance": 1.0 - sq_err / total_var,
        "mse": sq_err / tokens,
        "l0": active / tokens,
        "dead_fraction": 1.0 - fired.float().mean().item(),
        "ce_clean": ce_clean,
        "ce_sae": ce["sae"],
        "ce_zero": ce["zero"],
        "ce_mean": ce["mean"],
        "ce_recovered": (ce["zero"] - ce["sae"]) / (ce["zero"] - ce_clean),
        "ce_recovered_mean": (ce["mean"] - ce["sae"]) / (ce["mean"] - ce_clean),
    }


def read_batches(
    run: LoadedRun, options: ReadOptions, device: torch.device
) -> tuple[np.ndarray, list[list[int]], list[tuple[Tensor, Tensor]], str]:
    """The tokens, window starts and `(x, y)` batches that `options` ask for, and their label."""
    tokens, label = eval_tokens(run, options.data)
    ctx = run.model.context_length
    starts = window_starts(
        len(tokens), ctx, options.batch_size or DEFAULT_BATCH, options.steps or DEFAULT_STEPS
    )
    return tokens, starts, list(window_batches(tokens, ctx, starts, device)), label


def measured(
    run: LoadedRun,
    options: ReadOptions,
    device: torch.device,
    measure: Callable[[list[tuple[Tensor, Tensor]]], dict[str, Any]],
) -> tuple[dict[str, Any], str]:
    """`measure`'s figures on the batches `options` ask for (`read_batches`), with the run's
    `train.threads` unless `--threads`, and the batches' label."""
    with torch_threads(options.threads or run.config.train.threads):
        _, _, batches, label = read_batches(run, options, device)
        return measure(batches), label


def evaluate_sae(
    options: ReadOptions = ReadOptions(),
    *,
    progress: bool = False,
    notify: Callable[[str], Any] = print,
) -> SAEEval:
    """`llmcli sae eval`: the SAE and run of `options` scored on their text (module doc).

    Raises:
        InputError: a bad SAE folder or run, or one that does not fit the other; a bad text.
    """
    t0 = time.perf_counter()
    loaded, run, device = open_sae(options, notify)
    figures, label = measured(
        run, options, device, lambda batches: measure(loaded, run, batches, progress=progress)
    )
    return SAEEval(
        sae=str(loaded.folder),
        run=str(run.run_dir),
        hook=loaded.info.hook,
        features=loaded.sae.d_sae,
        data=label,
        elapsed_s=time.perf_counter() - t0,
        **figures,
    )


def format_eval(result: SAEEval) -> str:
    """A few lines for people."""
    return (
        f"SAE {result.sae}: {result.features:,} features at {result.hook} of run {result.run}\n"
        f"data: {result.data}, {result.tokens:,} tokens\n"
        f"explained variance {result.explained_variance:.4f}, mean L0 {result.l0:.2f}, "
        f"dead {result.dead_fraction:.2%} (no activation on these tokens)\n"
        f"loss (nats/token): clean {result.ce_clean:.4f}, SAE spliced in {result.ce_sae:.4f}, "
        f"zero-ablated {result.ce_zero:.4f}, mean-ablated {result.ce_mean:.4f}\n"
        f"ce_recovered {result.ce_recovered:.4f} (against zero ablation), "
        f"{result.ce_recovered_mean:.4f} (against mean ablation)"
    )
