"""What the training loop writes: a log step's record (`log_step`), an evaluation with its
heads' scores (`evaluate_and_log`), a checkpoint (`save`), the stop after Ctrl-C or SIGTERM
(`save_and_stop`), and what a run reports at its end (`summary`).

Circuits during training: with `train.head_metrics`, each evaluation also scores every head on
the fixed repeated-token probe (`llmcli.evaluation.probe`) and takes the in-context learning
score from the loss by position; the summaries go into the evaluation's record, the grids into
`head_metrics.jsonl` (`llmcli.runs.head_metrics`). Scoring touches no random number generator.
On conversations (`data.format: chat`) the heads are scored as on text, but there is no
in-context learning score: a window's positions follow the chat template's turns, and the loss
is on the assistant's tokens only, so its loss by position measures the template, not the use
of context.

A save writes every file to a temporary name and renames it into place
(`llmcli.runs.directory.save_checkpoint`), with every rank's RNG and sampler states, so a crash
at any instant leaves the last good checkpoint, and a resumed run continues exactly
(`llmcli.training.state`): `metrics.jsonl` is cut back to what it held at the save, and the
resumed run writes the same records again (only `elapsed_s` and `tok_per_s` differ).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from llmcli.errors import describe_os_error
from llmcli.evaluation.metrics import icl_score, perplexity
from llmcli.evaluation.probe import probe_scores
from llmcli.progress import Progress
from llmcli.runs.directory import METRICS_FILE, PLOT_FILE, save_checkpoint
from llmcli.runs.metrics import plot_losses
from llmcli.runs.versions import record as record_versions
from llmcli.training.distributed import gather
from llmcli.training.evaluate import evaluate_loss
from llmcli.training.interrupt import Preempted
from llmcli.training.layers import LayerWatch
from llmcli.training.run import Run, eval_samplers
from llmcli.training.safeguards import diverged
from llmcli.training.state import rng_state

logger = logging.getLogger(__name__)


def log_step(
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


def evaluate_and_log(run: Run, lr: float) -> bool:
    """Estimate the train and val loss (with `train.head_metrics`, score the heads too), log
    them, redraw the curve; True for a new best."""
    tc = run.config.train
    evaluation = evaluate_loss(
        run.evaluated,
        eval_samplers(run),
        tc.eval_steps,
        run.precision,
        run.info,
        by_position=tc.head_metrics and run.data.chat is None,
    )
    state, losses = run.state, evaluation.mean
    val = losses["val"]
    if not math.isfinite(val):
        raise diverged(run, state.step, val)
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
        heads = score_heads(run, evaluation.by_position.get("val")) if probe is not None else {}
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


def score_heads(run: Run, val_by_position: list[float] | None) -> dict[str, float]:
    """Rank 0: every head's scores on the probe and the in-context learning score (none without
    a loss by position: chat data); the grids go to head_metrics.jsonl, the summaries
    (returned) to metrics.jsonl."""
    assert run.log is not None and run.log.probe is not None and run.log.head_log is not None
    probe = run.log.probe
    scores = probe_scores(run.model, probe)  # touches no RNG: the training stream stays
    icl = {}
    if val_by_position is not None:
        icl = {"val_loss_by_position": val_by_position, "icl_score": icl_score(val_by_position)}
    run.log.head_log.write(
        {
            "step": run.state.step,
            "tokens": run.state.tokens,
            "probe": probe.describe(),
            **scores.grids(),
            **icl,
        }
    )
    icl.pop("val_loss_by_position", None)
    return {**scores.summary(), **icl}


def save_and_stop(run: Run, preempted: bool) -> None:
    """Save (unless this step was just saved) and leave the loop with KeyboardInterrupt, or
    `Preempted` (its subclass) after SIGTERM."""
    if run.state.last_saved != run.state.step:
        save(run, best=False)
    if run.info.main:
        logger.warning(
            "stopped at step %d; the checkpoint in '%s' is saved: "
            "continue with the same command and --resume (or --resume auto)",
            run.state.step,
            run.run_dir,
        )
    raise Preempted if preempted else KeyboardInterrupt


def save(run: Run, best: bool) -> None:
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
            "tokenizer_training": run.tokenizer_training,
            "compiled": run.compiled,  # train.compile's choice, which a resumed run keeps
        }
        if run.data.chat is not None:  # how many conversations fit, were cut or left out
            meta["chat_data"] = run.data.chat.counts()
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


def summary(run: Run, elapsed_s: float, tok_rate: float | None) -> TrainSummary:
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
