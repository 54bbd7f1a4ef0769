"""The training loop: build a run, then step, log, evaluate and save.

`train(config)` trains the model `config.model` describes on the corpus `config.data` names and
writes a run directory (layout in `llmcli.runs.directory`). Everything the loop works with is
built first (`llmcli.training.run`); `fit` is the loop, as in nanoGPT: set the learning rate,
take one step (`llmcli.training.step.train_step`), then log, evaluate and save when due. What
keeps a run safe sits beside it as named steps: the out-of-memory retry and the spike guard
(`llmcli.training.safeguards`), what is read from the device (`llmcli.training.readout`), what
is written (`llmcli.training.records`: records, evaluations, atomic saves, the stop), the resume
state (`llmcli.training.state`) and Ctrl-C (`llmcli.training.interrupt`).

Each step's loss stays on the device until a log step (every `log_interval` steps) reads them
all at once. Saves come at every evaluation, every `train.save_interval` steps, and at the first
log step `train.save_interval_s` seconds after the last one. Under `torchrun` every process runs
this loop on its own stream of batches (`llmcli.training.distributed`); all ranks learn at the
same log step that one of them must save or stop; rank 0 alone writes files and shows progress.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm.contrib.logging import logging_redirect_tqdm

from llmcli.config import Config, TrainConfig
from llmcli.device import resolve_device, torch_threads
from llmcli.errors import InputError
from llmcli.progress import Progress
from llmcli.runs.directory import default_run_dir
from llmcli.runs.trackers import check_available
from llmcli.training.distributed import dist_from_env, process_group
from llmcli.training.interrupt import StopRequest
from llmcli.training.layers import LayerWatch
from llmcli.training.memory import out_of_memory_is_bad_input
from llmcli.training.optim import apply_lr
from llmcli.training.precision import Precision
from llmcli.training.readout import LossLog, TokenRate, agreed_flags
from llmcli.training.records import (
    TrainSummary,
    evaluate_and_log,
    log_step,
    save,
    save_and_stop,
    summary,
)
from llmcli.training.run import Run, build_run, open_run_files
from llmcli.training.safeguards import UpdateCheck, check_finite, fitting_step, refused

logger = logging.getLogger(__name__)


def train(
    config: Config,
    *,
    out_dir: str | Path | None = None,
    resume: bool | str = False,
    overwrite: bool = False,
    progress: bool = True,
    on_step: Callable[[int], None] | None = None,
) -> TrainSummary:
    """Train `config`'s model on its corpus, writing a run directory; resumable, DDP-aware.

    Args:
        config: a validated config.
        out_dir: the run directory (default `train.out_dir`, else `checkpoints/<config name>`).
        resume: continue the run saved in the run directory exactly where it was saved;
            "auto": continue it if the directory holds a resume state, else start.
        overwrite: start afresh even if the run directory already holds a run, or files
            that are not a run's (those are kept).
        progress: show progress (rank 0): a bar on a terminal, plain lines elsewhere.
        on_step: called with the step number after every optimizer step (for tests: it may
            raise or send a signal to simulate a crash or Ctrl-C at a chosen step).

    Returns:
        A `TrainSummary` (on every rank; only rank 0 wrote files).

    Raises:
        InputError: bad config, data, device or run directory, or a diverging loss
            (`DivergenceError`); each message says what to change.
        KeyboardInterrupt: after Ctrl-C, once the checkpoint is saved.
    """
    session_start = time.perf_counter()
    if resume and overwrite:
        raise InputError(
            f"--resume{' auto' if resume == 'auto' else ''} and --overwrite contradict each "
            "other: continue the run in the folder, or start it afresh; give one of them."
        )
    check_available(config.train.loggers)  # a missing tracker package: before any work
    info = dist_from_env()
    device = resolve_device(config.train.device, info.local_rank)
    precision = Precision.resolve(device, config.train.dtype)
    run_dir = Path(out_dir) if out_dir is not None else default_run_dir(config)
    with (
        torch_threads(config.train.threads),
        process_group(info, device),
        out_of_memory_is_bad_input(device, run_dir),
    ):
        run = build_run(config, info, precision, run_dir, resume, overwrite, session_start)
        if run.state.step >= config.train.max_steps:
            if info.main:
                logger.info(
                    "'%s' already finished at step %d (train.max_steps = %d): raise "
                    "train.max_steps to train further",
                    run_dir,
                    run.state.step,
                    config.train.max_steps,
                )
            return summary(run, run.state.elapsed_base, None)
        open_run_files(run)
        return fit(run, progress, on_step)


def fit(run: Run, progress: bool, on_step: Callable[[int], None] | None = None) -> TrainSummary:
    """Step, log, evaluate, save: until `max_steps`, a divergence or Ctrl-C."""
    tc, state, info = run.config.train, run.state, run.info
    bar = Progress(
        tc.max_steps, desc="train", unit="step", initial=state.step, enabled=progress and info.main
    )
    losses, loop_start, loop_step = LossLog(), time.perf_counter(), state.step
    speed = TokenRate(loop_start, state.tokens)
    run.saved_at = loop_start
    files = run.log if run.log is not None else contextlib.nullcontext()
    with StopRequest(escalate=not info.enabled) as stop, logging_redirect_tqdm(), bar, files:
        while state.step < tc.max_steps:
            lr = apply_lr(run.trainer.optimizer, state.step, tc, _lr_scale(run))
            due = _due(state.step + 1, tc)  # known before the step: a log step wants the norm
            check = UpdateCheck(run, LayerWatch(run.model) if _watch(run, due) else None)
            loss, norm, applied = fitting_step(run, check)
            if not applied:  # the spike guard skipped the step, or rolled back
                refused(run, check.verdict, losses)
                speed.rewind(state.tokens)
                continue
            losses.add(loss)
            state.step += 1
            state.tokens += run.tokens_per_step
            bar.update(1)
            if on_step is not None:
                on_step(state.step)

            # Alone, a stop acts at once; under DDP, every rank stops at the next log step.
            if not (due.log or due.save or (stop.requested and not info.enabled)):
                continue
            # The one place the host reads the device: the losses, and every rank's flags.
            step_losses = losses.read(info)
            check_finite(run, step_losses)
            flags = agreed_flags(run, stop)
            tok_s = speed.read(state.tokens)
            if due.log:  # (a stop between log steps writes no record)
                log_step(run, bar, lr, step_losses[-1], tok_s, norm, check.watch)
            if due.evaluate or due.save or flags.timed_save:
                best = evaluate_and_log(run, lr) if due.evaluate else False  # each evaluation saves
                save(run, best)
                speed.restart(state.tokens)  # tokens/s leaves evaluations and saves out
            if flags.stop:
                save_and_stop(run, preempted=flags.terminated)
    session_s = time.perf_counter() - loop_start
    steps = state.step - loop_step
    tok_rate = steps * run.tokens_per_step / session_s if session_s > 0 else None
    return summary(run, state.elapsed, tok_rate)


@dataclass(frozen=True)
class _Due:
    """What the schedule asks of the loop after a step, besides the step itself."""

    log: bool  # read the losses and flags, write a record (every evaluation logs too)
    evaluate: bool  # estimate the losses, then save
    save: bool  # save the resume state (`train.save_interval`)


def _due(step: int, tc: TrainConfig) -> _Due:
    """What the loop does after `step`, by `train.log_interval`, `eval_interval`, `max_steps`
    and `save_interval`; saves by the clock and stops are `Flags`."""
    evaluate = step % tc.eval_interval == 0 or step == tc.max_steps
    return _Due(
        log=evaluate or step % tc.log_interval == 0,
        evaluate=evaluate,
        save=tc.save_interval is not None and step % tc.save_interval == 0,
    )


def _watch(run: Run, due: _Due) -> bool:
    """Whether this step's layers are measured (`train.log_layers`, rank 0, log steps)."""
    return run.config.train.log_layers and due.log and run.info.main


def _lr_scale(run: Run) -> float:
    """The spike guard's factor on the learning rate (lowered for a while after a rollback)."""
    return run.guard.lr_scale(run.state.step) if run.guard is not None else 1.0
