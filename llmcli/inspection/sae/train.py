"""`llmcli sae train`: a sparse autoencoder trained on a hook point of a run, as its own training
data streams through the model.

Each step draws random windows of the run's training split (`BatchSampler`, its own seed), runs
the model up to the hook point only (`points.read_activations`), and takes one Adam step of the
SAE on those activations: no activation is stored beyond the step that uses it. The loss is the
reconstruction's squared error (summed over channels, averaged over tokens) plus AuxK
(`model.aux_reconstruction`, weight `aux_coef`): the features that have not fired for
`dead_tokens` tokens reconstruct what the live ones missed, which gives them a gradient back to
life. Dead features are counted, not resampled: `dead_fraction` in `metrics.jsonl` and in `sae
eval` is the share of features that have not fired for `dead_tokens` tokens (in eval: on any
token scored). The decoder rows are kept at unit norm (the gradient along a row is dropped
before the step, the row rescaled after). The learning rate is constant, then decays linearly
over the last fifth of the steps, to 0 at the last step.

A save writes the SAE (SAELens's format, `llmcli.inspection.sae.folder`), then the resume state
(`llmcli.inspection.sae.state`) last: every `save_interval` steps, at the end, and at Ctrl-C.
`--resume` goes on from it exactly. Threads and device are chosen as `train` chooses them
(`train.threads` of the run unless `--threads`; `--device`).
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
from tqdm.contrib.logging import logging_redirect_tqdm

from llmcli.claim import claimed_folder, missing_folders
from llmcli.data.batches import BatchSampler
from llmcli.data.tokens import prepare_data
from llmcli.device import check_threads, resolve_device, torch_threads
from llmcli.errors import InputError
from llmcli.fileio import remove_stale_temp_files
from llmcli.inspection.sae.config import SAEConfig
from llmcli.inspection.sae.folder import (
    CFG_FILE,
    METRICS_FILE,
    STATE_FILE,
    SAEInfo,
    save_sae,
)
from llmcli.inspection.sae.model import SparseAutoencoder, aux_reconstruction
from llmcli.inspection.sae.points import check_hook, read_activations
from llmcli.inspection.sae.state import SAEState
from llmcli.progress import Progress
from llmcli.runs.loading import LoadedRun, load_run
from llmcli.runs.metrics import JsonLinesLog
from llmcli.training.interrupt import Preempted, StopRequest
from llmcli.training.optim import learning_rate

logger = logging.getLogger(__name__)

#: Features per channel of the hook point when `--features` is not given.
DEFAULT_EXPANSION = 16
#: The last fraction of the steps over which the learning rate decays to 0.
DECAY_FRACTION = 0.2


@dataclass(frozen=True)
class TrainOptions:
    """Where `train_sae` reads and writes, besides what it trains (`SAEConfig`).

    Attributes:
        checkpoint: the run (None: the latest under `checkpoints/`).
        out: the SAE folder (None: `<run>/sae/<hook>/`).
        resume: go on from the folder's `state.pt`.
        overwrite: start afresh in a folder that holds an SAE (its files are replaced).
        weights: the run's "best" or "last" weights.
        device: "auto", "cpu", "cuda" or "mps".
        threads: CPU threads (None: the run's `train.threads`).
    """

    checkpoint: str | Path | None = None
    out: str | Path | None = None
    resume: bool = False
    overwrite: bool = False
    weights: str = "best"
    device: str = "auto"
    threads: int | None = None

    def __post_init__(self) -> None:
        check_threads(self.threads)
        if self.resume and self.overwrite:
            raise InputError(
                "--resume goes on with the saved SAE and --overwrite replaces it: give one of them."
            )


@dataclass
class TrainSummary:
    """Where a training got to: `llmcli sae train` prints it."""

    folder: Path
    step: int
    steps: int
    tokens: int
    elapsed_s: float
    last: dict[str, float]  # the last logged figures (mse, explained_variance, l0, ...)


@dataclass
class _Training:
    """What the loop works with, built by `_build`."""

    config: SAEConfig
    run: LoadedRun
    folder: Path
    sae: SparseAutoencoder
    optimizer: torch.optim.Optimizer
    sampler: BatchSampler
    since_fired: torch.Tensor  # (F,) long
    step: int = 0
    tokens: int = 0
    elapsed_base: float = 0.0
    metrics_bytes: int | None = None  # metrics.jsonl's size at the save resumed from


def lr_at(config: SAEConfig, step: int) -> float:
    """The learning rate of step `step` (0-based): `config.lr`, then down linearly over the
    last `DECAY_FRACTION` of the steps to 0 at the last step (`train`'s wsd schedule, without
    warmup)."""
    return learning_rate(
        step,
        lr=config.lr,
        min_lr=0.0,
        warmup_steps=0,
        max_steps=config.steps,
        schedule="wsd",
        decay_fraction=DECAY_FRACTION,
    )


def sae_step(
    sae: SparseAutoencoder,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    dead: torch.Tensor,
    aux_coef: float,
    lr: float,
) -> dict[str, Any]:
    """One optimizer step of `sae` on the activations `x` `(N, d_in)`.

    Args:
        dead: `(F,)` bool, the features counted dead (AuxK trains them on the residual).
        aux_coef: AuxK's weight.
        lr: this step's learning rate.

    Returns:
        The step's figures: `mse` (summed over channels, mean over rows), `fvu` (the share of
        the variance left unexplained), `l0` (features active per row), `aux` (AuxK's loss),
        and `fired` (`(F,)` bool: the features active on any row).
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    N = x.shape[0]
    pre = sae.pre_acts(x)  # (N, F)
    rows, features, values = sae.select(pre)
    x_hat = sae.decode_sparse(rows, features, values, N)  # (N, d_in)
    mse = (x_hat - x).pow(2).sum(-1).mean()
    loss, aux = mse, torch.zeros(())
    n_dead = int(dead.sum())
    if n_dead and aux_coef > 0:
        # Gao et al. (2024), appendix B.1: the d_in / 2 largest dead features, and a loss
        # scaled down when fewer are dead (the scale is taken before k_aux is cut to n_dead).
        k_aux = max(1, sae.d_in // 2)
        residual = (x - x_hat).detach()  # (N, d_in)
        aux_hat = aux_reconstruction(sae, pre, dead, residual, min(k_aux, n_dead))  # (N, d_in)
        aux = (aux_hat - residual).pow(2).sum(-1).mean()
        loss = loss + aux_coef * min(n_dead / k_aux, 1.0) * aux
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    sae.remove_parallel_grad_()
    optimizer.step()
    sae.normalize_decoder_()
    active = values > 0
    if sae.activation == "batchtopk":
        sae.update_threshold(values)
    with torch.no_grad():
        variance = (x - x.mean(0)).pow(2).sum(-1).mean()
    fired = torch.zeros(sae.d_sae, dtype=torch.bool, device=x.device)
    fired[features[active]] = True
    return {
        "mse": mse.item(),
        "fvu": (mse / variance).item(),
        "l0": active.sum().item() / N,
        "aux": aux.item(),
        "fired": fired,
    }


def train_sae(
    config: SAEConfig,
    options: TrainOptions = TrainOptions(),
    *,
    progress: bool = False,
    notify: Callable[[str], Any] = logger.warning,
) -> TrainSummary:
    """Train (or go on training) a sparse autoencoder on a hook point of a run.

    Raises:
        InputError: a bad run, hook point or setting; a folder that holds an SAE without
            `--resume` or `--overwrite`; a resume whose settings or run differ from the saved.
    """
    device = resolve_device(options.device, what="--device")
    run = load_run(options.checkpoint, weights=options.weights, device=device, notify=notify)
    folder = sae_folder(run, config.hook, options.out)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--out '{folder}' is a file: give a folder for the SAE.")
    made = missing_folders(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with (
        claimed_folder(
            folder,
            made,
            f"the SAE folder '{folder}'",
            fix="Wait for it to end (Ctrl-C saves its state) and go on with --resume, or "
            "write this SAE elsewhere with --out DIR.",
        ),
        torch_threads(options.threads or run.config.train.threads),
    ):
        training = _build(config, options, run, folder, device, notify)
        log = JsonLinesLog(training.folder / METRICS_FILE, training.metrics_bytes)
        try:
            return _loop(training, log, progress)
        finally:
            log.close()
            training.sampler.close()


def sae_folder(run: LoadedRun, hook: str, out: str | Path | None) -> Path:
    """The SAE folder: `out`, else `<run>/sae/<hook>/`."""
    return Path(out) if out is not None else run.run_dir / "sae" / hook


def _build(
    config: SAEConfig,
    options: TrainOptions,
    run: LoadedRun,
    folder: Path,
    device: torch.device,
    notify: Callable[[str], Any],
) -> _Training:
    """The SAE in `folder` (claimed), its optimizer and the window stream, fresh or restored
    from `state.pt`."""
    model = run.model
    d_in = check_hook(model, config.hook)
    features = config.features or DEFAULT_EXPANSION * d_in
    config = dataclasses.replace(config, features=features)  # checks k <= features
    check_folder(folder, options)
    ctx = model.context_length
    data = prepare_data(run.config.data, ctx, tokenizer=run.tokenizer)
    windows = math.ceil(config.batch_tokens / ctx)
    sampler = BatchSampler(data.train, windows, ctx, config.seed, device=device)
    generator = torch.Generator().manual_seed(config.seed)
    sae = SparseAutoencoder(d_in, features, config.k, config.activation, generator=generator)
    sae.to(device).train()
    optimizer = torch.optim.Adam(sae.parameters(), lr=config.lr, betas=(0.9, 0.999))
    since_fired = torch.zeros(features, dtype=torch.long, device=device)
    training = _Training(config, run, folder, sae, optimizer, sampler, since_fired)
    if options.resume:
        _restore(training, SAEState.load(folder / STATE_FILE))
        notify(f"resuming the SAE in {folder} at step {training.step}")
    return training


def check_folder(folder: Path, options: TrainOptions, config_file: str = CFG_FILE) -> None:
    """A fresh start needs a folder without an SAE (or --overwrite); a resume, a state.
    `config_file` is what a saved one holds beside `state.pt` (transcoders: `config.yaml`)."""
    held = [name for name in (config_file, STATE_FILE) if (folder / name).is_file()]
    if options.resume and not (folder / STATE_FILE).is_file():
        raise InputError(
            f"--resume: '{folder}' holds no {STATE_FILE} to go on from; leave out --resume to "
            "train one."
        )
    if held and not (options.resume or options.overwrite):
        raise InputError(
            f"'{folder}' already holds an SAE ({', '.join(held)}): --resume goes on training "
            "it, --overwrite trains a new one in its place, --out DIR writes elsewhere."
        )
    remove_stale_temp_files(folder)


def _restore(training: _Training, state: SAEState) -> None:
    """Put a saved state back into a freshly built training, after checking it fits."""
    training.config.resumable(state.settings, state.step)
    run = training.run
    if state.run_step != run.step:
        raise InputError(
            f"the SAE was trained on run '{state.run}' at step {state.run_step}, and the run "
            f"loaded ('{run.run_dir}') is at step {run.step}: its activations have changed; "
            "train a new SAE (--overwrite)."
        )
    try:
        training.sae.load_state_dict(state.sae)
        training.optimizer.load_state_dict(state.optimizer)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise InputError(f"the SAE resume state does not fit this SAE ({exc}).") from None
    training.sampler.load_state_dict(state.sampler)
    training.since_fired.copy_(state.since_fired)
    training.step, training.tokens = state.step, state.tokens
    training.elapsed_base, training.metrics_bytes = state.elapsed_s, state.metrics_bytes


def _save(training: _Training, log: JsonLinesLog, elapsed: float) -> None:
    """The SAE in SAELens's format, then the resume state (the save's commit point)."""
    config, run = training.config, training.run
    info = SAEInfo(config.hook, str(run.run_dir), config.to_dict(), training.step, training.tokens)
    save_sae(training.folder, training.sae, info, run.model.context_length)
    SAEState(
        sae=training.sae.state_dict(),
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
    config, sae, model = training.config, training.sae, training.run.model
    start = time.perf_counter()

    def elapsed() -> float:  # this session's seconds, and the sessions' before it
        return training.elapsed_base + time.perf_counter() - start

    bar = Progress(
        config.steps, desc="sae train", unit="step", initial=training.step, enabled=progress
    )
    window: list[dict[str, Any]] = []  # the figures of the steps since the last log line
    last: dict[str, float] = {}
    # Ctrl-C or SIGTERM asks for a stop at the end of the step: a step cut short would save
    # a sampler one batch ahead of the weights (or half an optimizer update).
    # Log lines (Ctrl-C's notice among them) go through the bar, as in `llmcli train`: written
    # over it, not after the "^C" the terminal echoed at its end.
    with StopRequest() as stop, logging_redirect_tqdm(), bar:
        while training.step < config.steps:
            x, _ = training.sampler.next()  # (B, T)
            acts = read_activations(model, config.hook, x)  # (B * T, d_in)
            if training.step == 0:  # start the decoder bias at the activations' mean
                with torch.no_grad():
                    sae.b_dec.copy_(acts.mean(0))
            dead = training.since_fired >= config.dead_tokens
            figures = sae_step(
                sae,
                training.optimizer,
                acts,
                dead,
                config.aux_coef,
                lr_at(config, training.step),
            )
            training.since_fired += len(acts)
            training.since_fired[figures.pop("fired")] = 0
            training.step += 1
            training.tokens += len(acts)
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
    if stop.requested:  # once the bar is closed: the last line says how it ended
        logger.warning(
            "stopped at step %d; the SAE in '%s' is saved: continue with the same command and "
            "--resume",
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
    """One `metrics.jsonl` record: the means of the steps since the last, and the counts now."""
    means = {key: sum(f[key] for f in window) / len(window) for key in ("mse", "fvu", "l0", "aux")}
    dead = training.since_fired >= training.config.dead_tokens
    record = {
        "kind": "sae",
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
