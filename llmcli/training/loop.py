"""The training loop: build a run, then step, log, evaluate and save.

`train(config)` trains the model `config.model` describes on the corpus `config.data` names and
writes a run directory (layout in `llmcli.runs.directory`). Everything the loop works with is
built first (`llmcli.training.build`); `fit` is the loop, as in nanoGPT: set the learning rate,
take one step (`llmcli.training.step.train_step`), then log, evaluate and save when due. What
keeps a run safe sits beside it, parts of the run with a narrow job each: the spike guard is the
step's `before_update` (`llmcli.training.guard`), the checkpointer saves, rolls back and stops
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
from functools import partial
from pathlib import Path

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from llmcli.config import Config, TrainConfig
from llmcli.objectives import objective_for
from llmcli.progress import WITHOUT_RATE, Progress
from llmcli.training.batch import may_shrink, shrink_micro_batch
from llmcli.training.build import Run, started
from llmcli.training.checkpoint import Checkpointer
from llmcli.training.counters import TrainState
from llmcli.training.interrupt import StopRequest
from llmcli.training.log import LossLog, TokenRate, TrainLog, TrainSummary, agreed_flags
from llmcli.training.optim import apply_lr
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
    with started(config, out_dir, resume, overwrite) as run:
        state, max_steps = run.state, run.config.train.max_steps
        if state.step >= max_steps and not state.eval_pending:
            if run.info.main:
                logger.info(
                    "'%s' already finished at step %d (train.max_steps = %d): raise "
                    "train.max_steps to train further",
                    run.facts.run_dir,
                    state.step,
                    max_steps,
                )
            return _summary(run, state.elapsed_base, None)
        with TrainLog.open(run.config, run.data, run.facts, run.info.main) as log:
            return fit(run, log, progress, on_step or (lambda step: None))


def fit(run: Run, log: TrainLog, progress: bool, on_step: Callable[[int], None]) -> TrainSummary:
    """Step, log, evaluate, save: until `max_steps`, a divergence or Ctrl-C."""
    config, state, trainer, info, guard = run.config, run.state, run.trainer, run.info, run.guard
    tc, checkpoints, divergence = config.train, run.checkpoints, run.divergence
    bar = Progress(
        tc.max_steps,
        desc="train",
        initial=state.step,
        enabled=progress and info.main,
        bar_format=WITHOUT_RATE,  # tok/s instead
    )
    losses, loop_start, loop_tokens = LossLog(), time.perf_counter(), state.tokens
    speed = TokenRate(loop_start, state.tokens)
    stopped, on_quit = None, partial(_quit_at_once, bar, checkpoints, state)  # a 2nd Ctrl-C
    with StopRequest(not info.enabled, on_quit) as stop, logging_redirect_tqdm(), bar:
        _evaluate_pending(run, log)  # a stop saved just before an evaluation: it comes first
        while state.step < tc.max_steps:
            lr_scale = guard.lr_scale(state.step) if guard is not None else 1.0  # a rollback's
            lr = apply_lr(trainer.optimizer, state.step, tc, lr_scale)
            due = _due(state.step + 1, tc)  # known before the step: a log step's layers
            watch = log.layer_watch(run.model, due.log)
            drawn = trainer.batches.tokens_drawn  # the step's real tokens: what it draws now
            try:
                loss, norm, applied, metrics = train_step(
                    trainer, before_update=all_of(watch, guard)
                )
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
                if checkpoints.refused(state, log, divergence):  # rolled back
                    losses.clear()  # the losses of the steps undone are not logged
                speed.rewind(state.tokens)
                continue
            losses.add(loss, metrics)
            state.step += 1
            state.tokens += (trainer.batches.tokens_drawn - drawn) * info.world_size
            bar.update(1)
            on_step(state.step)

            # Alone, a stop acts at once; under DDP, every rank stops at the next log step.
            if not (due.log or due.save or (stop.requested and not info.enabled)):
                continue
            # The one place the host reads the device: the losses, and every rank's flags.
            step_losses = losses.read(info)
            divergence.check(step_losses, state.step - len(step_losses) + 1, state.last_saved)
            timed = checkpoints.due_by_clock(tc.save_interval_s)
            flags = agreed_flags(stop, timed, info, trainer.precision.device)
            tok_s = speed.read(state.tokens)
            if due.log:  # (a stop between log steps writes no record)
                metrics_now = losses.read_metrics(info)
                mfu = run.facts.mfu(tok_s)
                used = {"mfu": round(mfu, 5)} if mfu is not None else {}
                log.train_step(state, lr, step_losses[-1], tok_s, norm, watch, metrics_now | used)
                loss_now = step_losses[-1]
                figures = log.bar_figures(metrics_now)  # the objective's: GRPO's reward, ...
                speed_lr = {"tok/s": f"{tok_s:,.0f}", **_mfu_text(mfu), "lr": f"{lr:.2e}"}
                bar.report({"loss": f"{loss_now:.4f}", **figures, **speed_lr})
            if flags.stop:  # save at once; an evaluation due now waits for the resumed run
                state.eval_pending = due.evaluate
                checkpoints.save(state, config, log, best=False)
                stopped = flags
                break
            if due.evaluate or due.save or flags.timed_save:
                best = _evaluate(run, config, log, lr) if due.evaluate else False  # each saves
                checkpoints.save(state, config, log, best)
                speed.restart(state.tokens)  # tokens/s leaves evaluations and saves out
    if stopped is not None:  # once the bar is closed: the last line says how the run ended
        checkpoints.stop(state, preempted=stopped.terminated)
    session_s = time.perf_counter() - loop_start
    tokens = state.tokens - loop_tokens
    return _summary(run, state.elapsed, tokens / session_s if session_s > 0 else None)


def _mfu_text(mfu: float | None) -> dict[str, str]:
    """The bar's MFU, as nanoGPT prints it: a percentage of the measured peak."""
    return {} if mfu is None else {"mfu": f"{100 * mfu:.1f}%"}


def _quit_at_once(bar: Progress, checkpoints: Checkpointer, state: TrainState) -> None:
    """A second Ctrl-C: the bar ends, then the last line says what is kept and what is lost."""
    bar.close()
    logger.warning("%s", checkpoints.quit_message(state))


def _evaluate(run: Run, config: Config, log: TrainLog, lr: float) -> bool:
    """Estimate the losses (and score the heads) at this step and log them; True when the
    validation loss is the best so far."""
    state = run.state
    result = run.evaluate(config)
    run.divergence.check([result.losses["val"]], state.step, state.last_saved)
    best = state.record_eval(result.losses)
    log.evaluation(state, lr, result, best)
    return best


def _evaluate_pending(run: Run, log: TrainLog) -> None:
    """The evaluation a stop saved just before (`TrainState.eval_pending`), if any, at the rate
    of the step it follows, then its save: the records an uninterrupted run writes there."""
    state, tc, guard = run.state, run.config.train, run.guard
    if not state.eval_pending:
        return
    lr_scale = guard.lr_scale(state.step - 1) if guard is not None else 1.0
    lr = apply_lr(run.trainer.optimizer, state.step - 1, tc, lr_scale)
    state.eval_pending = False
    run.checkpoints.save(state, run.config, log, _evaluate(run, run.config, log, lr))


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


def _summary(run: Run, elapsed_s: float, tokens_per_s: float | None) -> TrainSummary:
    """What the run reports at its end."""
    saves, max_steps = run.checkpoints.save_seconds, run.config.train.max_steps
    summary = TrainSummary.of(
        run.state, run.facts, max_steps, saves, run.guard, elapsed_s, tokens_per_s
    )
    if not objective_for(run.config).has_perplexity:  # a DPO or GRPO loss is no LM loss
        summary.val_ppl = None
    return summary
