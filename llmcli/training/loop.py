"""The training loop: build a run, then step, log, evaluate and save.

`train(config)` trains the model `config.model` describes on the corpus `config.data` names and
writes a run directory (layout in `llmcli.runs.directory`). Everything the loop works with is
built first (`llmcli.training.build`); `fit` is the loop, as in nanoGPT: set the learning rate,
take one step (`llmcli.training.step.train_step`), then log, evaluate and save when due. What
keeps a run safe sits beside it, each part with a narrow job: the spike guard is the step's
`before_update` (`llmcli.training.guard`), the checkpointer saves and rolls back
(`llmcli.training.checkpoint`), the log reads the device and writes the records
(`llmcli.training.log`), `llmcli.training.interrupt` turns Ctrl-C into a stop, and an automatic
micro-batch that runs out of memory in the first steps shrinks (`llmcli.training.batch`).

Each step's loss stays on the device until a log step (every `log_interval` steps) reads them
all at once. Saves come at every evaluation, every `train.save_interval` steps, and at the first
log step `train.save_interval_s` seconds after the last one. Under `torchrun` every process runs
this loop on its own stream of batches (`llmcli.training.distributed`); all ranks learn at the
same log step that one of them must save or stop; rank 0 alone writes files and shows progress.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from llmcli.config import Config, TrainConfig
from llmcli.device import resolve_device, torch_threads
from llmcli.errors import InputError
from llmcli.evaluation.metrics import perplexity
from llmcli.progress import Progress, format_count
from llmcli.runs.directory import default_run_dir
from llmcli.runs.trackers import check_available
from llmcli.training.batch import may_shrink, shrink_micro_batch
from llmcli.training.build import Run, build_run
from llmcli.training.checkpoint import Checkpointer, finite_or_none
from llmcli.training.distributed import dist_from_env, process_group
from llmcli.training.guard import Divergence, SpikeGuard
from llmcli.training.interrupt import Preempted, StopRequest
from llmcli.training.layers import LayerWatch
from llmcli.training.log import LossLog, TokenRate, TrainLog, agreed_flags
from llmcli.training.memory import out_of_memory_is_bad_input
from llmcli.training.optim import apply_lr
from llmcli.training.precision import Precision
from llmcli.training.state import RunFacts, TrainState
from llmcli.training.step import all_of, train_step

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
        if run.state.step >= run.config.train.max_steps:
            if info.main:
                logger.info(
                    "'%s' already finished at step %d (train.max_steps = %d): raise "
                    "train.max_steps to train further",
                    run_dir,
                    run.state.step,
                    run.config.train.max_steps,
                )
            return summarize(run, run.state.elapsed_base, None)
        log = TrainLog.open(run.config, run.data, run.facts, info.main)
        if info.main:
            _announce(run.config, run.facts, run.state.step)
        with log:
            return fit(run, log, progress, on_step or (lambda step: None))


def fit(
    run: Run, log: TrainLog, progress: bool, on_step: Callable[[int], None] = lambda step: None
) -> TrainSummary:
    """Step, log, evaluate, save: until `max_steps`, a divergence or Ctrl-C."""
    config, state, trainer, info, guard = run.config, run.state, run.trainer, run.info, run.guard
    tc, checkpoints = config.train, run.checkpoints
    divergence = Divergence(tc, run.facts.run_dir, guarded=guard is not None)
    bar = Progress(
        tc.max_steps, desc="train", unit="step", initial=state.step, enabled=progress and info.main
    )
    losses, loop_start, loop_step = LossLog(), time.perf_counter(), state.step
    speed = TokenRate(loop_start, state.tokens)
    checkpoints.saved_at = loop_start
    with StopRequest(escalate=not info.enabled) as stop, logging_redirect_tqdm(), bar:
        while state.step < tc.max_steps:
            lr = apply_lr(trainer.optimizer, state.step, tc, _lr_scale(guard, state.step))
            due = _due(state.step + 1, tc)  # known before the step: a log step's layers
            watch = LayerWatch(run.model) if tc.log_layers and due.log and info.main else None
            try:
                loss, norm, applied = train_step(trainer, before_update=all_of(watch, guard))
            except torch.OutOfMemoryError:
                if not (run.shrinks and may_shrink(config, state.step)):
                    raise
                applied = None
            if applied is None:  # out of the handler: the failed step's memory is free now
                config = run.config = shrink_micro_batch(
                    config, trainer, state.step, run.facts.tokens_per_step
                )
                log.rewrite_config(config)
                continue
            if not applied:  # the spike guard refused the update
                assert guard is not None
                _refused(guard, checkpoints, log, losses, divergence)
                speed.rewind(state.tokens)
                continue
            losses.add(loss)
            state.step += 1
            state.tokens += run.facts.tokens_per_step
            bar.update(1)
            on_step(state.step)

            # Alone, a stop acts at once; under DDP, every rank stops at the next log step.
            if not (due.log or due.save or (stop.requested and not info.enabled)):
                continue
            # The one place the host reads the device: the losses, and every rank's flags.
            step_losses = losses.read(info)
            first = state.step - len(step_losses) + 1
            divergence.check(step_losses, first, state.last_saved)
            timed = checkpoints.due_by_clock(tc.save_interval_s)
            flags = agreed_flags(stop, timed, info, trainer.precision.device)
            tok_s = speed.read(state.tokens)
            if due.log:  # (a stop between log steps writes no record)
                log.train_step(state, lr, step_losses[-1], tok_s, norm, watch)
                bar.report(
                    {"loss": f"{step_losses[-1]:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tok_s:,.0f}"}
                )
            if due.evaluate or due.save or flags.timed_save:
                best = False
                if due.evaluate:  # each evaluation saves
                    result = run.evaluate(config)
                    divergence.check([result.losses["val"]], state.step, state.last_saved)
                    best = state.record_eval(result.losses)
                    log.evaluation(state, lr, result, best)
                checkpoints.save(state, config, log, best)
                speed.restart(state.tokens)  # tokens/s leaves evaluations and saves out
            if flags.stop:
                _save_and_stop(checkpoints, state, config, log, preempted=flags.terminated)
    session_s = time.perf_counter() - loop_start
    steps = state.step - loop_step
    tok_rate = steps * run.facts.tokens_per_step / session_s if session_s > 0 else None
    return summarize(run, state.elapsed, tok_rate)


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


def _lr_scale(guard: SpikeGuard | None, step: int) -> float:
    """The spike guard's factor on the learning rate (lowered for a while after a rollback)."""
    return guard.lr_scale(step) if guard is not None else 1.0


def _refused(
    guard: SpikeGuard,
    checkpoints: Checkpointer,
    log: TrainLog,
    losses: LossLog,
    divergence: Divergence,
) -> None:
    """After the spike guard refused a step: log the skip, and roll the run back to its last
    save when the guard says so, or stop it (`DivergenceError`) when it cannot recover."""
    verdict, state = guard.verdict, guard.counters
    assert verdict is not None and verdict.event is not None
    step, loss = verdict.event["step"], verdict.event["loss"]
    log.event(verdict.event, f"step {step} skipped ({verdict.event['reason']}, loss {loss:.4g})")
    can_roll_back = state.last_saved >= 0
    if verdict.action == "rollback" and can_roll_back:
        event = checkpoints.rollback(state, log, step, loss)
        losses.clear()  # the losses of the steps undone are not logged
        log.event(
            event,
            f"rolled back to step {event['to_step']} (rollback {event['rollback']}): learning "
            f"rate x {event['lr_factor']:g} until step {event['lr_until_step']}, on new batches",
        )
    elif verdict.action != "skip":
        what = guard.stop_advice(verdict.event, can_roll_back)
        raise divergence.error(what, state.last_saved)


def _save_and_stop(
    checkpoints: Checkpointer, state: TrainState, config: Config, log: TrainLog, preempted: bool
) -> None:
    """Save (unless this step was just saved) and leave the loop with KeyboardInterrupt, or
    `Preempted` (its subclass) after SIGTERM."""
    if state.last_saved != state.step:
        checkpoints.save(state, config, log, best=False)
    if checkpoints.info.main:
        logger.warning(
            "stopped at step %d; the checkpoint in '%s' is saved: "
            "continue with the same command and --resume (or --resume auto)",
            state.step,
            checkpoints.run_dir,
        )
    raise Preempted if preempted else KeyboardInterrupt


def _announce(config: Config, facts: RunFacts, step: int) -> None:
    """Say what starts: the notes on a short run, then the run, its size, device and steps."""
    for note in config.train.short_run_notes():
        logger.warning(note)
    logger.info(
        "%s run '%s': %s parameters, %s on %s%s, %d tokens per step, steps %d..%d",
        "resuming" if facts.resumed_from is not None else "starting",
        facts.run_dir,
        format_count(facts.n_params),
        facts.dtype,
        facts.device,
        f" x{facts.world_size}" if facts.world_size > 1 else "",
        facts.tokens_per_step,
        step + 1,
        config.train.max_steps,
    )


def summarize(run: Run, elapsed_s: float, tok_rate: float | None) -> TrainSummary:
    """What the run reports at its end."""
    state, facts, guard = run.state, run.facts, run.guard
    val = state.last_eval.get("val")
    saves = run.checkpoints.save_seconds
    return TrainSummary(
        run_dir=facts.run_dir,
        step=state.step,
        max_steps=run.config.train.max_steps,
        tokens=state.tokens,
        elapsed_s=elapsed_s,
        train_loss=state.last_eval.get("train"),
        val_loss=val,
        val_ppl=perplexity(val) if val is not None else None,
        best_val_loss=finite_or_none(state.best_val_loss),
        tokens_per_s=tok_rate,
        n_params=facts.n_params,
        device=facts.device,
        dtype=facts.dtype,
        world_size=facts.world_size,
        rank=facts.rank,
        resumed_from=facts.resumed_from,
        saves=len(saves),
        save_s=max(saves, default=None),
        skipped=guard.state.skips if guard is not None else 0,
        rollbacks=guard.state.rollbacks if guard is not None else 0,
    )


@dataclass
class TrainSummary:
    """What a finished (or already complete) run reports."""

    run_dir: Path
    step: int
    max_steps: int
    tokens: int
    elapsed_s: float
    train_loss: float | None
    val_loss: float | None
    val_ppl: float | None
    best_val_loss: float | None
    tokens_per_s: float | None
    n_params: int
    device: str
    dtype: str
    world_size: int
    rank: int
    resumed_from: int | None
    saves: int = 0  # checkpoints written in this session
    save_s: float | None = None  # the longest of them, seconds (what a preemption must allow)
    skipped: int = 0  # steps the spike guard skipped, in the whole run
    rollbacks: int = 0  # ... and its rollbacks
