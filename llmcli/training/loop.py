"""The training loop: build a run, then step, log, evaluate and save.

`train(config)` trains the model `config.model` describes on the corpus `config.data` names and
writes a run directory (layout in `llmcli.runs.directory`). Everything the loop works with is
built first (`llmcli.training.run`); `fit` is the loop, as in nanoGPT: set the learning rate,
take one step (`llmcli.training.step.train_step`: `grad_accum` micro-batches of `batch_size`
sequences of `context_length` tokens on every rank), then log, evaluate and save when due. What
keeps a run safe sits beside it as named helpers: the out-of-memory retry (`_fitting_step`), the
spike guard (`_judge`, `_refused`; `llmcli.training.guard`), the resume state
(`llmcli.training.state`), atomic saves (`llmcli.runs.directory`), agreement between ranks
(`llmcli.training.distributed`) and Ctrl-C (`llmcli.training.interrupt`).

Reading the device. Each step's loss stays on the device until a log step (every
`log_interval` steps) reads them all at once, where a NaN or inf is found and named by its
step; with the spike guard on (the default) each step also reads its loss and gradient norm,
two numbers, for the guard's verdict.

Saves: at every evaluation, every `train.save_interval` steps, and at the first log step
`train.save_interval_s` seconds after the last save, so that a kill loses bounded work; all ranks
learn at the same step that a save (or a stop) is due, through an all-reduce of the flags at
the log step.

Circuits during training: with `train.head_metrics`, each evaluation also scores every head on
the fixed repeated-token probe (`llmcli.evaluation.probe`) and takes the in-context learning
score from the loss by position; the summaries go into the evaluation's record, the grids into
`head_metrics.jsonl` (`llmcli.runs.head_metrics`). Scoring touches no random number generator.

Exact resume: see `llmcli.training.state`. `metrics.jsonl` is cut back to what it held at the save
a run resumes from, and the resumed run writes the same records again (only `elapsed_s` and
`tok_per_s` differ).

Distributed. Under `torchrun --nproc_per_node=N -m llmcli train CONFIG` each process joins a
process group (gloo on CPU, nccl on CUDA) and wraps the model in DDP. Rank r draws its own
stream: its `BatchSampler(rank=r, world_size=N)`. Gradient accumulation skips the all-reduce
(`no_sync`) on every micro-step but the last. Rank 0 alone writes files and shows the progress
bar; logged losses are averaged over ranks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from llmcli.config import Config, TrainConfig
from llmcli.device import resolve_device, torch_threads
from llmcli.errors import InputError, describe_os_error
from llmcli.evaluation.metrics import icl_score, perplexity
from llmcli.evaluation.probe import probe_scores
from llmcli.progress import Progress
from llmcli.runs.directory import METRICS_FILE, PLOT_FILE, default_run_dir, save_checkpoint
from llmcli.runs.metrics import plot_losses
from llmcli.runs.trackers import check_available
from llmcli.runs.versions import record as record_versions
from llmcli.training.distributed import (
    DistInfo,
    dist_from_env,
    gather,
    mean_over_ranks,
    process_group,
)
from llmcli.training.evaluate import evaluate_loss
from llmcli.training.guard import Verdict
from llmcli.training.interrupt import Preempted, StopRequest
from llmcli.training.layers import LayerWatch
from llmcli.training.memory import out_of_memory_is_bad_input
from llmcli.training.optim import apply_lr
from llmcli.training.precision import Precision
from llmcli.training.run import Run, build_run, eval_samplers, open_run_files
from llmcli.training.state import rng_state
from llmcli.training.step import train_step

logger = logging.getLogger(__name__)


class DivergenceError(InputError):
    """The loss became NaN or infinite (too high a learning rate, usually)."""


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
        overwrite: start afresh even if the run directory already holds a run.
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
            return _summary(run, run.state.elapsed_base, None)
        open_run_files(run)
        return fit(run, progress, on_step)


def fit(run: Run, progress: bool, on_step: Callable[[int], None] | None = None) -> TrainSummary:
    """Step, log, evaluate, save: until `max_steps`, a divergence or Ctrl-C."""
    tc, state, info = run.config.train, run.state, run.info
    bar = Progress(
        tc.max_steps, desc="train", unit="step", initial=state.step, enabled=progress and info.main
    )
    losses, loop_start, loop_step = _Losses(), time.perf_counter(), state.step
    speed = _TokenRate(loop_start, state.tokens)
    run.saved_at = loop_start
    files = run.log if run.log is not None else contextlib.nullcontext()
    with StopRequest(escalate=not info.enabled) as stop, logging_redirect_tqdm(), bar, files:
        while state.step < tc.max_steps:
            lr = apply_lr(run.trainer.optimizer, state.step, tc, _lr_scale(run))
            due = _due(state.step + 1, tc)  # known before the step: a log step wants the norm
            check = _BeforeUpdate(run, LayerWatch(run.model) if _watch(run, due) else None)
            loss, norm = _fitting_step(run, check)
            if check.verdict is not None:  # the spike guard skipped the step, or rolled back
                _refused(run, check.verdict, losses)
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
            _check_finite(run, step_losses)
            flags = _agreed_flags(run, stop)
            tok_s = speed.read(state.tokens)
            if due.log:  # (a stop between log steps writes no record)
                _log(run, bar, lr, step_losses[-1], tok_s, norm, check.watch)
            if due.evaluate or due.save or flags.timed_save:
                best = _evaluate(run, lr) if due.evaluate else False  # each evaluation saves
                _save(run, best)
                speed.restart(state.tokens)  # tokens/s leaves evaluations and saves out
            if flags.stop:
                _stop(run, preempted=flags.terminated)
    session_s = time.perf_counter() - loop_start
    steps = state.step - loop_step
    tok_rate = steps * run.tokens_per_step / session_s if session_s > 0 else None
    return _summary(run, state.elapsed, tok_rate)


# ---------------------------------------------------------------------------------------------
# Around the step: the schedule, the out-of-memory retry, the layer watch and the spike guard
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Due:
    """What the schedule asks of the loop after a step, besides the step itself."""

    log: bool  # read the losses and flags, write a record (every evaluation logs too)
    evaluate: bool  # estimate the losses, then save
    save: bool  # save the resume state (`train.save_interval`)


def _due(step: int, tc: TrainConfig) -> _Due:
    """What the loop does after `step`, by `train.log_interval`, `eval_interval`, `max_steps`
    and `save_interval`; saves by the clock and stops are `_Flags`."""
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


def _fitting_step(run: Run, check: _BeforeUpdate) -> tuple[torch.Tensor, torch.Tensor]:
    """`train_step`; in a fresh run's first steps, an automatic micro-batch that runs out of
    memory is made smaller and the step tried again (`Run.shrink_micro_batch`)."""
    while True:
        try:
            loss, norm, applied = train_step(run.trainer, check)
            break
        except torch.OutOfMemoryError:
            if not run.can_shrink_batch():
                raise
        # Outside the handler: the failed step's tensors are free by now.
        run.shrink_micro_batch()
    if applied and check.watch is not None:
        check.watch.after_step()
    return loss, norm


class _BeforeUpdate:
    """What looks at a step's gradients before the weights change: the layer watch
    (`train.log_layers`: each layer's gradient norm, and the weights before the update) and the
    spike guard, whose verdict on a step it refuses is kept for the loop (`verdict`)."""

    def __init__(self, run: Run, watch: LayerWatch | None) -> None:
        self.run, self.watch = run, watch
        self.verdict: Verdict | None = None

    def __call__(self, loss: torch.Tensor, norm: torch.Tensor) -> bool:
        if self.watch is not None:
            self.watch.read_grads()  # unscaled, before clipping
        if self.run.guard is not None:
            verdict = _judge(self.run, loss, norm)
            if verdict.event is not None:
                self.verdict = verdict
                return False
        if self.watch is not None:
            self.watch.before_step()
        return True


def _judge(run: Run, loss: torch.Tensor, norm: torch.Tensor) -> Verdict:
    """The spike guard's verdict on the step just computed (`llmcli.training.guard`), from its
    loss and gradient norm read from the device (the means over ranks: every rank decides
    alike); under fp16 the norm is the GradScaler's to judge."""
    assert run.guard is not None
    values = torch.stack([loss, norm]).float()
    mean_over_ranks(values, run.info)
    loss_value, norm_value = values.tolist()
    judged_norm = None if run.precision.scales_loss else norm_value
    return run.guard.check(run.state.step + 1, loss_value, judged_norm)


def _refused(run: Run, verdict: Verdict, losses: _Losses) -> None:
    """After the spike guard refused a step: log the skip, roll the run back to its last save
    when the guard says so, or stop it (`DivergenceError`) when it cannot recover."""
    assert run.guard is not None and verdict.event is not None
    step, loss = verdict.event["step"], verdict.event["loss"]
    _event(run, verdict.event, f"step {step} skipped ({verdict.event['reason']}, loss {loss:.4g})")
    can_roll_back = run.state.last_saved >= 0
    if verdict.action == "rollback" and can_roll_back:
        event = run.rollback(step, loss)
        losses.clear()  # the losses of the steps undone are not logged
        _event(
            run,
            event,
            f"rolled back to step {event['to_step']} (rollback {event['rollback']}): learning "
            f"rate x {event['lr_factor']:g} until step {event['lr_until_step']}, on new batches",
        )
    elif verdict.action != "skip":
        raise _diverged(run, step, loss, run.guard.stop_advice(verdict.event, can_roll_back))


def _event(run: Run, record: dict, message: str) -> None:
    """Rank 0: a spike-guard event into metrics.jsonl (and the trackers), and a warning."""
    if run.log is not None:
        run.log.metrics.write(record)
        logger.warning("spike guard: %s", message)


# ---------------------------------------------------------------------------------------------
# What the loop reads from the device at log steps
# ---------------------------------------------------------------------------------------------


class _Losses:
    """Each applied step's loss, kept on the device until the loop reads them all at once."""

    def __init__(self) -> None:
        self.pending: list[torch.Tensor] = []

    def add(self, loss: torch.Tensor) -> None:
        self.pending.append(loss)

    def clear(self) -> None:
        self.pending = []

    def read(self, info: DistInfo) -> list[float]:
        """The loss of each step since the last read (under DDP the mean over ranks, which
        step alike)."""
        values = torch.stack(self.pending)
        mean_over_ranks(values, info)
        self.pending = []
        return values.tolist()


@dataclass(frozen=True)
class _Flags:
    """What any rank asks of all of them when the loop reads the device."""

    stop: bool = False  # Ctrl-C or SIGTERM: save and stop
    terminated: bool = False  # ... by SIGTERM (a scheduler's preemption): exit status 143
    timed_save: bool = False  # `train.save_interval_s` passed since the last save


def _agreed_flags(run: Run, stop: StopRequest) -> _Flags:
    """This rank's flags, raised on every rank if any rank raised them (one all-reduce under
    DDP), so that all learn at the same step that one of them was asked to stop or to save."""
    interval = run.config.train.save_interval_s
    flags = (
        stop.requested,
        stop.signum == signal.SIGTERM,
        interval is not None and time.perf_counter() - run.saved_at >= interval,
    )
    if run.info.enabled:
        raised = torch.tensor(flags, dtype=torch.float, device=run.device)
        mean_over_ranks(raised, run.info)
        flags = tuple(v > 0 for v in raised.tolist())
    return _Flags(*flags)


class _TokenRate:
    """Training tokens per second between reads; `restart` leaves evaluations and saves out."""

    def __init__(self, start: float, tokens: int) -> None:
        self.start, self.tokens = start, tokens

    def read(self, tokens: int) -> float:
        """Tokens per second since the last read or restart, which this read ends."""
        now = time.perf_counter()
        rate = (tokens - self.tokens) / max(now - self.start, 1e-9)
        self.start, self.tokens = now, tokens
        return rate

    def restart(self, tokens: int) -> None:
        self.start, self.tokens = time.perf_counter(), tokens

    def rewind(self, tokens: int) -> None:
        """After a rollback the count goes back: the rate counts from there (the time spent on
        the steps undone counts against it)."""
        self.tokens = min(self.tokens, tokens)


def _check_finite(run: Run, step_losses: list[float]) -> None:
    first = run.state.step - len(step_losses) + 1
    for offset, value in enumerate(step_losses):
        if not math.isfinite(value):
            raise _diverged(run, first + offset, value)


def _diverged(run: Run, step: int, value: float, what: str | None = None) -> DivergenceError:
    """The message of a diverged run: `what` happened (default: the loss became `value` at
    `step`), the last good checkpoint, and what to change."""
    lr, saved = run.config.train.lr, run.state.last_saved
    kept = (
        f"the last good checkpoint (step {saved}) in '{run.run_dir}' is intact"
        if saved >= 0
        else "no checkpoint was saved before it"
    )
    what = what or f"the loss became {value} at step {step}: training diverged"
    return DivergenceError(
        f"{what}, {kept}. Lower the learning rate (train.lr = {lr:g}; try --set "
        f"train.lr={lr / 3:.3g}), or raise train.warmup_steps or lower train.grad_clip"
        + (", and check the data around this step." if run.guard is not None else ".")
    )


def _log(
    run: Run,
    bar: Progress,
    lr: float,
    loss: float,
    tok_s: float,
    norm: torch.Tensor | None,
    watch: LayerWatch | None,
) -> None:
    """Rank 0: one `metrics.jsonl` record, and the figures beside the bar (or a plain line)."""
    if run.log is None:
        return
    state = run.state
    record = {
        "kind": "train",
        "step": state.step,
        "tokens": state.tokens,
        "elapsed_s": round(state.elapsed, 3),
        "lr": lr,
        "train_loss": loss,
        "tok_per_s": round(tok_s, 1),
    }
    if norm is not None:
        record["grad_norm"] = norm.item()  # the gradient norm of this step, before clipping
    if watch is not None:
        record["layers"] = watch.record()
    run.log.metrics.write(record)
    bar.report({"loss": f"{loss:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tok_s:,.0f}"})


def _evaluate(run: Run, lr: float) -> bool:
    """Estimate the train and val loss (with `train.head_metrics`, score the heads too), log
    them, redraw the curve; True for a new best."""
    tc = run.config.train
    evaluation = evaluate_loss(
        run.evaluated,
        eval_samplers(run),
        tc.eval_steps,
        run.precision,
        run.info,
        by_position=tc.head_metrics,
    )
    state, losses = run.state, evaluation.mean
    val = losses["val"]
    if not math.isfinite(val):
        raise _diverged(run, state.step, val)
    best = state.record_eval(losses)
    if run.log is not None:
        record = {
            "kind": "eval",
            "step": state.step,
            "tokens": state.tokens,
            "elapsed_s": round(state.elapsed, 3),
            "lr": lr,
            "train_loss": losses["train"],
            "val_loss": val,
            "val_ppl": perplexity(val),
        }
        probe = run.log.probe
        heads = _score_heads(run, evaluation.by_position["val"]) if probe is not None else {}
        run.log.metrics.write({**record, **heads})
        logger.info(
            "step %d: train loss %.4f, val loss %.4f (ppl %.2f)%s%s",
            state.step,
            losses["train"],
            val,
            perplexity(val),
            f", induction_max {heads['induction_max']:.3f}" if heads else "",
            ", best so far" if best else "",
        )
        try:
            plot_losses(run.run_dir / METRICS_FILE, run.run_dir / PLOT_FILE)
        except OSError as exc:
            logger.warning("could not draw %s: %s", PLOT_FILE, describe_os_error(exc))
    return best


def _score_heads(run: Run, val_by_position: list[float]) -> dict[str, float]:
    """Rank 0: every head's scores on the probe and the in-context learning score; the grids go
    to head_metrics.jsonl, the summaries (returned) to metrics.jsonl."""
    assert run.log is not None and run.log.probe is not None and run.log.head_log is not None
    probe = run.log.probe
    scores = probe_scores(run.model, probe)  # touches no RNG: the training stream stays
    icl = icl_score(val_by_position)
    run.log.head_log.write(
        {
            "step": run.state.step,
            "tokens": run.state.tokens,
            "probe": probe.describe(),
            **scores.grids(),
            "val_loss_by_position": val_by_position,
            "icl_score": icl,
        }
    )
    return {**scores.summary(), "icl_score": icl}


def _stop(run: Run, preempted: bool) -> None:
    """Save (unless this step was just saved) and leave the loop with KeyboardInterrupt, or
    `Preempted` (its subclass) after SIGTERM."""
    if run.state.last_saved != run.state.step:
        _save(run, best=False)
    if run.info.main:
        logger.warning(
            "stopped at step %d; the checkpoint in '%s' is saved: "
            "continue with the same command and --resume (or --resume auto)",
            run.state.step,
            run.run_dir,
        )
    raise Preempted if preempted else KeyboardInterrupt


def _save(run: Run, best: bool) -> None:
    """Write a checkpoint of this step (rank 0), with every rank's RNG and sampler state."""
    state, info = run.state, run.info
    start = time.perf_counter()
    rngs_and_samplers = gather((rng_state(run.device), run.trainer.batches.state_dict()), info)
    if run.log is not None:
        vocab = int(run.tokenizer.vocab_size)
        meta = {
            "step": state.step,
            "max_steps": run.config.train.max_steps,
            "tokens": state.tokens,
            "elapsed_s": round(state.elapsed, 3),
            "best_val_loss": _finite(state.best_val_loss),
            "best_step": state.best_step,
            "last_eval": state.last_eval,
            "vocab_size": vocab,
            "n_params": run.model.num_parameters(),
            "device": str(run.device),
            "dtype": run.precision.name,
            "world_size": info.world_size,
            "versions": record_versions(),
            # the shipped config's name finds the run's reference curve (llmcli.runs.reference)
            "config_name": run.config.name,
        }
        save_checkpoint(
            run.run_dir,
            run.model,
            run.resume_state(rngs_and_samplers).to_dict(),
            meta,
            best=best,
            previous_step=state.last_saved,
        )
    state.last_saved = state.step
    run.saved_at = time.perf_counter()
    run.save_seconds.append(run.saved_at - start)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _summary(run: Run, elapsed_s: float, tok_rate: float | None) -> TrainSummary:
    state = run.state
    val = state.last_eval.get("val")
    return TrainSummary(
        run_dir=run.run_dir,
        step=state.step,
        max_steps=run.config.train.max_steps,
        tokens=state.tokens,
        elapsed_s=elapsed_s,
        train_loss=state.last_eval.get("train"),
        val_loss=val,
        val_ppl=perplexity(val) if val is not None else None,
        best_val_loss=_finite(state.best_val_loss),
        tokens_per_s=tok_rate,
        n_params=run.model.num_parameters(),
        device=str(run.device),
        dtype=run.precision.name,
        world_size=run.info.world_size,
        rank=run.info.rank,
        resumed_from=run.resumed_from,
        saves=len(run.save_seconds),
        save_s=max(run.save_seconds, default=None),
        skipped=run.guard.state.skips if run.guard is not None else 0,
        rollbacks=run.guard.state.rollbacks if run.guard is not None else 0,
    )
