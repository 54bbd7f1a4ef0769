"""The training loop that an SAE's training (`train`) and a transcoder set's
(`transcoder_train`) share: the claimed folder, the restore, the steps, the `metrics.jsonl`
records, the saves, the progress bar and the Ctrl-C (or SIGTERM) stop.

What differs is asked of a `Trainee`: its modules, its step on a batch of windows, how it writes
its folder, and the words its messages use. A save writes the trainee's folder, then the resume
state (`SAEState`, the modules' state dict in its `sae`) last: every `save_interval` steps, at
the end, and at Ctrl-C.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from llmcli.claim import claimed_folder, missing_folders
from llmcli.data.batches import BatchSampler
from llmcli.device import torch_threads
from llmcli.errors import InputError
from llmcli.inspection.sae.config import SAEConfig
from llmcli.inspection.sae.folder import METRICS_FILE, STATE_FILE
from llmcli.inspection.sae.state import SAEState
from llmcli.progress import Progress
from llmcli.runs.loading import LoadedRun
from llmcli.runs.metrics import JsonLinesLog
from llmcli.training.interrupt import Preempted, StopRequest
from llmcli.training.optim import learning_rate

logger = logging.getLogger(__name__)

#: The last fraction of the steps over which the learning rate decays to 0.
DECAY_FRACTION = 0.2


@dataclass
class TrainSummary:
    """Where a training got to: `llmcli sae train` prints it."""

    folder: Path
    step: int
    steps: int
    tokens: int
    elapsed_s: float
    last: dict[str, float]  # the last logged figures (mse, explained_variance, l0, ...)


@dataclass(frozen=True)
class Wording:
    """What the loop's messages call the thing trained (`str.format` fields in braces)."""

    resuming: str  # {folder} {step}
    stale_run: str  # {run} {run_step} {run_dir} {step}: the run has moved on since the save
    misfit: str  # {exc}: the saved state does not fit the modules built
    saved: str  # {folder}: the stop's notice


class Trainee(Protocol):
    """What one kind of training supplies to the loop."""

    kind: str  # the `kind` of each metrics.jsonl record
    desc: str  # the progress bar's label
    wording: Wording
    modules: torch.nn.Module

    def step(
        self,
        x: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        dead: torch.Tensor,
        lr: float,
        first: bool,
    ) -> dict[str, Any]:
        """One step of `optimizer` (on `modules`) on the windows `x` `(B, T)`: the figures
        `mse`, `fvu`, `l0`, `aux`, and `fired` (bool, the shape of `dead`). `first`: the
        training's first step."""
        ...

    def save(self, folder: Path, step: int, tokens: int) -> None:
        """Write the trained modules into `folder` in their own format."""
        ...


@dataclass
class Training:
    """What the loop works with, built by `start`."""

    config: SAEConfig
    run: LoadedRun
    folder: Path
    trainee: Trainee
    optimizer: torch.optim.Optimizer
    sampler: BatchSampler
    since_fired: torch.Tensor  # long, the shape of a step's `fired`
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


def train_in_folder(
    folder: Path,
    claim: tuple[str, str],
    threads: int,
    build: Callable[[], Training],
    progress: bool,
) -> TrainSummary:
    """Claim `folder` (`claim`: what it is and the fix, for `claimed_folder`), then train what
    `build` makes there, with `threads` CPU threads."""
    made = missing_folders(folder)
    folder.mkdir(parents=True, exist_ok=True)
    what, fix = claim
    with claimed_folder(folder, made, what, fix=fix), torch_threads(threads):
        training = build()
        log = JsonLinesLog(training.folder / METRICS_FILE, training.metrics_bytes)
        try:
            return _loop(training, log, progress)
        finally:
            log.close()
            training.sampler.close()


def start(
    config: SAEConfig,
    run: LoadedRun,
    folder: Path,
    trainee: Trainee,
    sampler: BatchSampler,
    fired_shape: tuple[int, ...],
    resume: bool,
    notify: Callable[[str], Any],
) -> Training:
    """The trainee's optimizer and fire counts (`fired_shape`, on the modules' device), fresh or
    restored from the folder's `state.pt`."""
    optimizer = torch.optim.Adam(trainee.modules.parameters(), lr=config.lr, betas=(0.9, 0.999))
    device = next(trainee.modules.parameters()).device
    since_fired = torch.zeros(fired_shape, dtype=torch.long, device=device)
    training = Training(config, run, folder, trainee, optimizer, sampler, since_fired)
    if resume:
        _restore(training, SAEState.load(folder / STATE_FILE))
        notify(trainee.wording.resuming.format(folder=folder, step=training.step))
    return training


def _restore(training: Training, state: SAEState) -> None:
    """Put a saved state back into a freshly built training, after checking it fits."""
    training.config.resumable(state.settings, state.step)
    run, wording = training.run, training.trainee.wording
    if state.run_step != run.step:
        raise InputError(
            wording.stale_run.format(
                run=state.run, run_step=state.run_step, run_dir=run.run_dir, step=run.step
            )
        )
    try:
        training.trainee.modules.load_state_dict(state.sae)
        training.optimizer.load_state_dict(state.optimizer)
        training.since_fired.copy_(state.since_fired)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise InputError(wording.misfit.format(exc=exc)) from None
    training.sampler.load_state_dict(state.sampler)
    training.step, training.tokens = state.step, state.tokens
    training.elapsed_base, training.metrics_bytes = state.elapsed_s, state.metrics_bytes


def _save(training: Training, log: JsonLinesLog, elapsed: float) -> None:
    """The trainee's folder, then the resume state (the save's commit point)."""
    config, run = training.config, training.run
    training.trainee.save(training.folder, training.step, training.tokens)
    SAEState(
        sae=training.trainee.modules.state_dict(),
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


def _loop(training: Training, log: JsonLinesLog, progress: bool) -> TrainSummary:
    """Step, log and save until `config.steps`; Ctrl-C saves, then stops."""
    config, trainee = training.config, training.trainee
    start = time.perf_counter()

    def elapsed() -> float:  # this session's seconds, and the sessions' before it
        return training.elapsed_base + time.perf_counter() - start

    bar = Progress(
        config.steps, desc=trainee.desc, unit="step", initial=training.step, enabled=progress
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
            dead = training.since_fired >= config.dead_tokens
            lr = lr_at(config, training.step)
            figures = trainee.step(x, training.optimizer, dead, lr, first=training.step == 0)
            training.since_fired += x.numel()
            training.since_fired[figures.pop("fired")] = 0
            training.step += 1
            training.tokens += x.numel()
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
            "stopped at step %d; %s: continue with the same command and --resume",
            training.step,
            trainee.wording.saved.format(folder=training.folder),
        )
        raise Preempted if stop.signum == signal.SIGTERM else KeyboardInterrupt
    _save(training, log, elapsed())
    return TrainSummary(
        training.folder, training.step, config.steps, training.tokens, elapsed(), last
    )


def _log(
    training: Training, log: JsonLinesLog, window: list[dict[str, Any]], elapsed: float
) -> dict[str, float]:
    """One `metrics.jsonl` record: the means of the steps since the last, and the counts now."""
    means = {key: sum(f[key] for f in window) / len(window) for key in ("mse", "fvu", "l0", "aux")}
    dead = training.since_fired >= training.config.dead_tokens
    record = {
        "kind": training.trainee.kind,
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
