"""`llmcli sae train --kind transcoder`: a transcoder per layer, trained as the run's own training
data streams through the model.

Each step draws random windows of the run's training split (`BatchSampler`, its own seed), runs
the model up to the last layer trained (`points.read_points`), and, for every layer at once,
reads the MLP's input (`blocks.{l}.mlp_in`) and output (`blocks.{l}.mlp_out`): each layer's
transcoder predicts the output from the input, and one Adam step takes the sum of their losses
(the layers share no parameter, so this is each layer's own step). A layer's loss is the squared
error of the prediction (summed over channels, averaged over tokens), plus relu's or tanh's
sparsity penalty (weight `sparsity_coef`), or, for topk and batchtopk, AuxK on the features dead
for `dead_tokens` tokens (`model.aux_reconstruction`, weight `aux_coef`). The learning rate is
`train.lr_at`'s, as for an SAE.

A save writes the set in circuit-tracer's layout (`transcoder_folder`), then the resume state
(`SAEState`, the set's state dict in its `sae`) last: every `save_interval` steps, at the end
and at Ctrl-C. `--resume` goes on from it exactly. The folder claim, the stop request and the
figures logged are those of an SAE's training (`train`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmcli.claim import claimed_folder, missing_folders
from llmcli.data.batches import BatchSampler
from llmcli.data.tokens import prepare_data
from llmcli.device import resolve_device, torch_threads
from llmcli.errors import InputError
from llmcli.inspection.sae.config import SAEConfig
from llmcli.inspection.sae.folder import METRICS_FILE, STATE_FILE
from llmcli.inspection.sae.model import aux_reconstruction
from llmcli.inspection.sae.points import read_points
from llmcli.inspection.sae.state import SAEState
from llmcli.inspection.sae.train import (
    DEFAULT_EXPANSION,
    TrainOptions,
    TrainSummary,
    check_folder,
    lr_at,
)
from llmcli.inspection.sae.transcoder import Transcoder, TranscoderSet
from llmcli.inspection.sae.transcoder_folder import (
    CONFIG_FILE,
    TranscoderInfo,
    save_transcoders,
)
from llmcli.progress import Progress
from llmcli.runs.loading import LoadedRun, load_run
from llmcli.runs.metrics import JsonLinesLog
from llmcli.training.interrupt import Preempted, StopRequest

logger = logging.getLogger(__name__)


def parse_layers(layers: str, n_layer: int) -> list[int]:
    """`--layers`: "all", or block indices joined by commas, each in `0..n_layer - 1`.

    Raises:
        InputError: an index that is not a whole number or not a layer of the run.
    """
    if layers.strip() == "all":
        return list(range(n_layer))
    try:
        chosen = sorted({int(part) for part in layers.split(",")})
    except ValueError:
        chosen = []
    if not chosen or chosen[0] < 0 or chosen[-1] >= n_layer:
        raise InputError(
            f"--layers ({layers!r}) must be all, or layers of the run joined by commas, each in "
            f"0..{n_layer - 1}."
        )
    return chosen


@dataclass
class _Training:
    """What the loop works with, built by `_build`."""

    config: SAEConfig
    run: LoadedRun
    folder: Path
    transcoders: TranscoderSet
    optimizer: torch.optim.Optimizer
    sampler: BatchSampler
    since_fired: torch.Tensor  # (L, F) long
    step: int = 0
    tokens: int = 0
    elapsed_base: float = 0.0
    metrics_bytes: int | None = None


def transcoder_step(
    transcoders: TranscoderSet,
    optimizer: torch.optim.Optimizer,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    dead: torch.Tensor,
    config: SAEConfig,
    lr: float,
) -> dict[str, Any]:
    """One optimizer step of every layer's transcoder.

    Args:
        pairs: per layer, the MLP's input and output rows, each `(N, C)`.
        dead: `(L, F)` bool, the features counted dead.
        config: the loss weights (`aux_coef`, `sparsity_coef`).
        lr: this step's learning rate.

    Returns:
        The means over layers of `mse`, `fvu`, `l0`, `aux` (AuxK's or the penalty's loss), and
        `fired` (`(L, F)` bool).
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = torch.zeros(())
    figures = {"mse": 0.0, "fvu": 0.0, "l0": 0.0, "aux": 0.0}
    fired = torch.zeros_like(dead)
    kept = []
    for i, (tc, (x, y)) in enumerate(zip(transcoders.transcoders, pairs, strict=True)):
        y_hat, pre, features, values = tc.training_output(x)  # (N, C), (N, F), (M,), (M,)
        mse = (y_hat - y).pow(2).sum(-1).mean()
        extra = config.sparsity_coef * tc.penalty(pre)
        n_dead = int(dead[i].sum())
        if tc.activation in ("topk", "batchtopk") and n_dead and config.aux_coef > 0:
            k_aux = max(1, tc.d_model // 2)  # as an SAE's AuxK (train.sae_step)
            residual = (y - y_hat).detach()  # (N, C)
            aux_hat = aux_reconstruction(tc, pre, dead[i], residual, min(k_aux, n_dead))
            extra = config.aux_coef * min(n_dead / k_aux, 1.0) * (aux_hat - residual).pow(2)
            extra = extra.sum(-1).mean()
        loss = loss + mse + extra
        active = values > 0
        fired[i, features[active]] = True
        kept.append(values)
        with torch.no_grad():
            variance = (y - y.mean(0)).pow(2).sum(-1).mean()
        figures["mse"] += mse.item()
        figures["fvu"] += (mse / variance).item()
        figures["l0"] += active.sum().item() / len(x)
        figures["aux"] += float(extra.detach())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    for tc, values in zip(transcoders.transcoders, kept, strict=True):
        if tc.activation == "batchtopk":
            tc.update_threshold(values)
    n = len(pairs)
    return {key: value / n for key, value in figures.items()} | {"fired": fired}


def train_transcoders(
    config: SAEConfig,
    options: TrainOptions = TrainOptions(),
    *,
    progress: bool = False,
    notify: Callable[[str], Any] = logger.warning,
) -> TrainSummary:
    """Train (or go on training) a transcoder set on a run (`config.kind == "transcoder"`).

    Raises:
        InputError: a bad run, layer or setting; a folder that holds a set without `--resume` or
            `--overwrite`; a resume whose settings or run differ from the saved.
    """
    device = resolve_device(options.device, what="--device")
    run = load_run(options.checkpoint, weights=options.weights, device=device, notify=notify)
    folder = Path(options.out) if options.out is not None else run.run_dir / "transcoders"
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--out '{folder}' is a file: give a folder for the transcoders.")
    layers = parse_layers(config.layers or "all", run.model.n_layer)
    made = missing_folders(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with (
        claimed_folder(
            folder,
            made,
            f"the transcoder folder '{folder}'",
            fix="Wait for it to end (Ctrl-C saves its state) and go on with --resume, or "
            "write these transcoders elsewhere with --out DIR.",
        ),
        torch_threads(options.threads or run.config.train.threads),
    ):
        training = _build(config, options, run, folder, layers, device, notify)
        log = JsonLinesLog(training.folder / METRICS_FILE, training.metrics_bytes)
        try:
            return _loop(training, log, progress)
        finally:
            log.close()
            training.sampler.close()


def _build(
    config: SAEConfig,
    options: TrainOptions,
    run: LoadedRun,
    folder: Path,
    layers: list[int],
    device: torch.device,
    notify: Callable[[str], Any],
) -> _Training:
    """The set in `folder` (claimed), its optimizer and the window stream, fresh or restored."""
    model = run.model
    C = model.n_embed
    features = config.features or DEFAULT_EXPANSION * C
    config = dataclasses.replace(config, features=features)  # checks k <= features
    check_folder(folder, options, CONFIG_FILE)
    ctx = model.context_length
    data = prepare_data(run.config.data, ctx, tokenizer=run.tokenizer)
    windows = math.ceil(config.batch_tokens / ctx)
    sampler = BatchSampler(data.train, windows, ctx, config.seed, device=device)
    generator = torch.Generator().manual_seed(config.seed)
    transcoders = TranscoderSet(
        layers,
        [
            Transcoder(C, features, config.k, config.activation, config.skip, generator=generator)
            for _ in layers
        ],
    )
    transcoders.to(device).train()
    optimizer = torch.optim.Adam(transcoders.parameters(), lr=config.lr, betas=(0.9, 0.999))
    since_fired = torch.zeros(len(layers), features, dtype=torch.long, device=device)
    training = _Training(config, run, folder, transcoders, optimizer, sampler, since_fired)
    if options.resume:
        _restore(training, SAEState.load(folder / STATE_FILE))
        notify(f"resuming the transcoders in {folder} at step {training.step}")
    return training


def _restore(training: _Training, state: SAEState) -> None:
    """Put a saved state back into a freshly built training, after checking it fits."""
    training.config.resumable(state.settings, state.step)
    run = training.run
    if state.run_step != run.step:
        raise InputError(
            f"the transcoders were trained on run '{state.run}' at step {state.run_step}, and "
            f"the run loaded ('{run.run_dir}') is at step {run.step}: its activations have "
            "changed; train new ones (--overwrite)."
        )
    try:
        training.transcoders.load_state_dict(state.sae)
        training.optimizer.load_state_dict(state.optimizer)
        training.since_fired.copy_(state.since_fired)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise InputError(f"the transcoder resume state does not fit ({exc}).") from None
    training.sampler.load_state_dict(state.sampler)
    training.step, training.tokens = state.step, state.tokens
    training.elapsed_base, training.metrics_bytes = state.elapsed_s, state.metrics_bytes


def _save(training: _Training, log: JsonLinesLog, elapsed: float) -> None:
    """The set in circuit-tracer's layout, then the resume state (the save's commit point)."""
    config, run = training.config, training.run
    info = TranscoderInfo(
        str(run.run_dir), config.to_dict(), run.step, training.step, training.tokens
    )
    save_transcoders(training.folder, training.transcoders, info)
    SAEState(
        sae=training.transcoders.state_dict(),
        optimizer=training.optimizer.state_dict(),
        sampler=training.sampler.state_dict(),
        since_fired=training.since_fired.cpu(),
        settings=config.to_dict(),
        run=str(run.run_dir),
        run_step=run.step,
        step=training.step,
        tokens=training.tokens,
        elapsed_s=elapsed,
        metrics_bytes=log.size,
    ).save(training.folder / STATE_FILE)


def _loop(training: _Training, log: JsonLinesLog, progress: bool) -> TrainSummary:
    """Step, log and save until `config.steps`; Ctrl-C saves, then stops."""
    config, transcoders, model = training.config, training.transcoders, training.run.model
    names = [f"blocks.{layer}.mlp_{end}" for layer in transcoders.layers for end in ("in", "out")]
    start = time.perf_counter()

    def elapsed() -> float:
        return training.elapsed_base + time.perf_counter() - start

    bar = Progress(
        config.steps, desc="transcoders", unit="step", initial=training.step, enabled=progress
    )
    window: list[dict[str, Any]] = []
    last: dict[str, float] = {}
    with StopRequest() as stop, bar:
        while training.step < config.steps:
            x, _ = training.sampler.next()  # (B, T)
            rows = read_points(model, names, x)  # each (B * T, C)
            pairs = [(rows[a], rows[b]) for a, b in zip(names[::2], names[1::2], strict=True)]
            if training.step == 0:  # start each decoder bias at its output's mean
                with torch.no_grad():
                    for tc, (_, y) in zip(transcoders.transcoders, pairs, strict=True):
                        tc.b_dec.copy_(y.mean(0))
            dead = training.since_fired >= config.dead_tokens
            lr = lr_at(config, training.step)
            figures = transcoder_step(transcoders, training.optimizer, pairs, dead, config, lr)
            training.since_fired += len(x.flatten())
            training.since_fired[figures.pop("fired")] = 0
            training.step += 1
            training.tokens += len(x.flatten())
            window.append(figures)
            bar.update()
            if training.step % config.log_interval == 0 or training.step == config.steps:
                last = _log(training, log, window, elapsed())
                bar.report(
                    {k: f"{last[k]:.3f}" for k in ("explained_variance", "l0", "dead_fraction")}
                )
                window = []
            if training.step % config.save_interval == 0 or stop.requested:
                _save(training, log, elapsed())
            if stop.requested:
                break
    if stop.requested:
        logger.warning(
            "stopped at step %d; the transcoders in '%s' are saved: continue with the same "
            "command and --resume",
            training.step,
            training.folder,
        )
        raise Preempted if stop.signum == signal.SIGTERM else KeyboardInterrupt
    _save(training, log, elapsed())
    return TrainSummary(
        training.folder, training.step, config.steps, training.tokens, elapsed(), last
    )


def _log(
    training: _Training, log: JsonLinesLog, window: list[dict[str, Any]], elapsed: float
) -> dict[str, float]:
    """One `metrics.jsonl` record: the means of the steps since the last (over layers too)."""
    means = {key: sum(f[key] for f in window) / len(window) for key in ("mse", "fvu", "l0", "aux")}
    dead = training.since_fired >= training.config.dead_tokens
    record = {
        "kind": "transcoder",
        "step": training.step,
        "tokens": training.tokens,
        "lr": lr_at(training.config, training.step - 1),
        "mse": means["mse"],
        "explained_variance": 1.0 - means["fvu"],
        "l0": means["l0"],
        "aux_loss": means["aux"],
        "dead_fraction": dead.float().mean().item(),
        "elapsed_s": elapsed,
    }
    log.write(record)
    return record
