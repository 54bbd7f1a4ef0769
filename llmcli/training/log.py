"""What the training loop reads from the device and what it logs.

Reading from the device waits for it, so the loop does it only at log steps: each step's loss
stays on the device until then (`LossLog`), and every rank's requests to stop or to save are
agreed in one collective (`agreed_flags`). `TokenRate` measures the tokens per second between
reads.

`TrainLog` writes what rank 0 records as the run goes, besides its checkpoints: at the start the
run's `config.yaml`, `tokenizer.json` (and a chat run's `chat_template.jinja`); then one
`metrics.jsonl` record per log step, per evaluation and per spike-guard event, each also sent to
the trackers (`llmcli.runs.trackers`); with `train.head_metrics`, each evaluation's head scores in
`head_metrics.jsonl` (`llmcli.runs.head_metrics`); and the loss picture, redrawn at every
evaluation. Both logs are `llmcli.runs.metrics.JsonLinesLog`s: a resumed run keeps their records
up to its save and writes the later ones again, so that they read as if it was never stopped
(only `elapsed_s` and `tok_per_s` differ). On the other ranks a `TrainLog` writes nothing.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmcli.config import Config
from llmcli.data.prepared import TokenData
from llmcli.errors import CheckpointError, describe_os_error
from llmcli.evaluation.metrics import perplexity
from llmcli.fileio import remove_stale_temp_files
from llmcli.objectives import Objective, objective_for
from llmcli.progress import format_count
from llmcli.runs.directory import (
    HEAD_METRICS_FILE,
    METRICS_FILE,
    PLOT_FILE,
    write_config,
    write_config_and_tokenizer,
)
from llmcli.runs.head_metrics import cut_to_step
from llmcli.runs.metrics import JsonLinesLog, plot_losses
from llmcli.runs.trackers import open_trackers
from llmcli.training.counters import TrainState
from llmcli.training.distributed import DistInfo, mean_over_ranks
from llmcli.training.evaluate import Evaluation
from llmcli.training.guard import SpikeGuard
from llmcli.training.interrupt import StopRequest
from llmcli.training.layers import LayerWatch
from llmcli.training.run_facts import RunFacts

logger = logging.getLogger(__name__)

# Log steps in a row whose gradient is zero (or whose objective says nothing is learned, as
# GRPO's groups that all tie) before the run says so on the terminal.
STALL_LOG_STEPS = 3


class LossLog:
    """Each applied step's loss, kept on the device until the loop reads them all at once, and
    the latest step's metrics (`llmcli.training.step.train_step`'s: DPO's rewards), which a log
    step records beside its loss."""

    def __init__(self) -> None:
        self.pending: list[torch.Tensor] = []
        self.metrics: dict[str, torch.Tensor] = {}

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor] | None = None) -> None:
        self.pending.append(loss)
        self.metrics = metrics or {}

    def clear(self) -> None:
        self.pending, self.metrics = [], {}

    def read_metrics(self, info: DistInfo) -> dict[str, float]:
        """The latest step's metrics by name (under DDP the mean over ranks; every rank must
        call this at the same step, as `read`)."""
        if not self.metrics:
            return {}
        values = torch.stack([self.metrics[name] for name in sorted(self.metrics)])
        mean_over_ranks(values, info)
        return dict(zip(sorted(self.metrics), values.tolist(), strict=True))

    def read(self, info: DistInfo) -> list[float]:
        """The loss of each step since the last read (under DDP the mean over ranks, which
        step alike)."""
        values = torch.stack(self.pending)
        mean_over_ranks(values, info)
        self.pending = []
        return values.tolist()


@dataclass(frozen=True)
class Flags:
    """What any rank asks of all of them when the loop reads the device."""

    stop: bool = False  # Ctrl-C or SIGTERM: save and stop
    terminated: bool = False  # ... by SIGTERM (a scheduler's preemption): exit status 143
    timed_save: bool = False  # `train.save_interval_s` passed since the last save


def agreed_flags(
    stop: StopRequest, timed_save: bool, info: DistInfo, device: torch.device
) -> Flags:
    """This rank's flags, raised on every rank if any rank raised them (one all-reduce under
    DDP), so that all learn at the same step that one of them was asked to stop or to save."""
    flags = (stop.requested, stop.signum == signal.SIGTERM, timed_save)
    if info.enabled:
        raised = torch.tensor(flags, dtype=torch.float, device=device)
        mean_over_ranks(raised, info)
        flags = tuple(v > 0 for v in raised.tolist())
    return Flags(*flags)


class TokenRate:
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


class TrainLog:
    """What rank 0 writes as the run goes, besides its checkpoints (see the module doc);
    `TrainLog.open` starts it. On other ranks (`metrics` None) it writes nothing."""

    def __init__(
        self,
        run_dir: Path,
        metrics: JsonLinesLog | None = None,
        heads: JsonLinesLog | None = None,
        log_layers: bool = False,
        objective: Objective | None = None,
        data: TokenData | None = None,
    ) -> None:
        self.run_dir, self.metrics, self.heads = run_dir, metrics, heads
        self.log_layers = log_layers  # train.log_layers
        self.objective, self.data = objective, data  # what the figures mean
        self.stalled: list[int] = []  # the log steps in a row where nothing was learned

    def layer_watch(self, model: nn.Module, log_step: bool) -> LayerWatch | None:
        """What measures each layer in a step whose record is written (`train.log_layers`,
        rank 0, log steps); None for the other steps."""
        if not (self.log_layers and log_step and self.metrics is not None):
            return None
        return LayerWatch(model)

    @classmethod
    def open(cls, config: Config, data: TokenData, facts: RunFacts, main: bool) -> TrainLog:
        """Rank 0: write config.yaml and tokenizer.json (and a chat run's template) into the
        run directory, open metrics.jsonl with the trackers (and head_metrics.jsonl), each cut
        back to its size at the save a run resumes from (`facts`).

        Raises:
            CheckpointError: the files cannot be written (the saved checkpoint is intact).
        """
        run_dir, resumed = facts.run_dir, facts.resumed_from is not None
        if not main:
            return cls(run_dir)
        remove_stale_temp_files(run_dir)
        template = data.chat.template if data.chat is not None else None
        if data.preference is not None:  # the init_from run's, passed on to the DPO run
            template = data.preference.template
        if data.prompts is not None:  # ... and to the GRPO run
            template = data.prompts.template
        try:
            write_config_and_tokenizer(run_dir, config, data.tokenizer, template)
            trackers = open_trackers(config, run_dir, facts.resumed_from)
            metrics_bytes = facts.metrics_bytes if resumed else None
            metrics = JsonLinesLog(run_dir / METRICS_FILE, metrics_bytes, trackers)
            heads = None
            if config.train.head_metrics:
                path, head_bytes = run_dir / HEAD_METRICS_FILE, facts.head_metrics_bytes
                if resumed and head_bytes is None:  # a state that did not record it
                    assert facts.resumed_from is not None
                    head_bytes = cut_to_step(path, facts.resumed_from)
                heads = JsonLinesLog(path, head_bytes if resumed else None)
        except OSError as exc:
            raise CheckpointError(
                f"cannot write the run files in '{run_dir}': {describe_os_error(exc)}. "
                "Any checkpoint saved there is intact; fix the problem and run again."
            ) from None
        _announce(config, facts)
        return cls(run_dir, metrics, heads, config.train.log_layers, objective_for(config), data)

    def train_step(
        self,
        state: TrainState,
        lr: float,
        loss: float,
        tok_s: float,
        norm: torch.Tensor,
        watch: LayerWatch | None,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """A log step's record: the step's loss, learning rate, speed and gradient norm, and
        its objective's `metrics` by name (DPO's `rewards/accuracies`, ...)."""
        if self.metrics is None:
            return
        record = {
            "kind": "train",
            "step": state.step,
            "tokens": state.tokens,
            "elapsed_s": round(state.elapsed, 3),
            "lr": lr,
            "train_loss": loss,
            "tok_per_s": round(tok_s, 1),
            "grad_norm": norm.item(),  # the gradient norm of this step, before clipping
            **(metrics or {}),
        }
        if watch is not None:
            record["layers"] = watch.record()
        self.metrics.write(record)
        self._watch_stall(state.step, record)

    def _watch_stall(self, step: int, record: dict[str, Any]) -> None:
        """Say on the terminal, once a streak, when `STALL_LOG_STEPS` log steps in a row had a
        zero gradient or figures that say nothing is learned (GRPO's tied groups)."""
        objective = self.objective
        if objective is None or (record["grad_norm"] != 0.0 and not objective.stalled(record)):
            self.stalled = []
            return
        self.stalled.append(step)
        if len(self.stalled) == STALL_LOG_STEPS:
            logger.warning(
                "nothing learned at the last %d log steps (steps %d..%d, gradient norm %g): %s",
                STALL_LOG_STEPS,
                self.stalled[0],
                step,
                record["grad_norm"],
                objective.stall_advice(record),
            )

    def bar_figures(self, metrics: dict[str, float]) -> dict[str, str]:
        """The step's figures the progress bar shows beside the loss (the objective's)."""
        names = () if self.objective is None else self.objective.bar_figures
        return {name: f"{metrics[name]:.3f}" for name in names if name in metrics}

    def evaluation(self, state: TrainState, lr: float, result: Evaluation, best: bool) -> None:
        """An evaluation's record (with its heads' scores, whose grids go to
        head_metrics.jsonl), a line in the log, and the loss picture redrawn."""
        if self.metrics is None:
            return
        losses = result.losses
        if self.heads is not None and result.heads is not None:
            self.heads.write({"step": state.step, "tokens": state.tokens, **result.heads})
        val, summary = losses["val"], result.summary
        record = {
            "kind": "eval",
            "step": state.step,
            "tokens": state.tokens,
            "elapsed_s": round(state.elapsed, 3),
            "lr": lr,
            "train_loss": losses["train"],
            "val_loss": val,
        }
        extra = None
        if self.objective is not None and self.data is not None:  # DPO's, GRPO's figures
            extra = self.objective.eval_text(summary, self.data)
        if extra is None:  # a next-token loss: its perplexity
            record["val_ppl"] = perplexity(val)
            extra = f" (ppl {perplexity(val):.2f})"
        self.metrics.write({**record, **summary})
        logger.info(
            "step %d: train loss %.4f, val loss %.4f%s%s%s",
            state.step,
            losses["train"],
            val,
            extra,
            f", strongest induction head {summary['induction_max']:.3f}"
            if "induction_max" in summary
            else "",
            ", best so far" if best else "",
        )
        try:
            plot_losses(self.run_dir / METRICS_FILE, self.run_dir / PLOT_FILE)
        except OSError as exc:
            logger.warning("could not draw %s: %s", PLOT_FILE, describe_os_error(exc))

    def event(self, record: dict[str, Any], message: str) -> None:
        """A spike-guard event into metrics.jsonl (and the trackers), and a warning."""
        if self.metrics is not None:
            self.metrics.write(record)
            logger.warning("spike guard: %s", message)

    def sizes(self) -> tuple[int, int | None]:
        """The sizes of metrics.jsonl and head_metrics.jsonl (None: not written), which a save
        records (0, None on the ranks that write nothing)."""
        metrics = self.metrics.size if self.metrics is not None else 0
        return metrics, self.heads.size if self.heads is not None else None

    def rewind(self, metrics_bytes: int, head_metrics_bytes: int | None) -> None:
        """Cut the logs back to their sizes at a save (a rollback), keeping event records."""
        if self.metrics is not None:
            self.metrics.rewind(metrics_bytes)
        if self.heads is not None and head_metrics_bytes is not None:
            self.heads.rewind(head_metrics_bytes)

    def rewrite_config(self, config: Config) -> None:
        """config.yaml again, after the loop changed the micro-batch (which the objective's
        figures count by)."""
        if self.metrics is not None:
            write_config(self.run_dir, config)
            self.objective = objective_for(config)

    def close(self) -> None:
        for log in (self.metrics, self.heads):
            if log is not None:
                log.close()

    def __enter__(self) -> TrainLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _announce(config: Config, facts: RunFacts) -> None:
    """Say what starts: the notes on a short run, then the run, its size, device and steps."""
    for note in config.train.short_run_notes():
        logger.warning(note)
    logger.info(
        "%s run '%s': %s parameters, %s on %s%s, %s tokens per step, steps %d..%d",
        "resuming" if facts.resumed_from is not None else "starting",
        facts.run_dir,
        format_count(facts.n_params),
        facts.dtype,
        facts.device,
        f" x{facts.world_size}" if facts.world_size > 1 else "",
        f"{'' if objective_for(config).full_rows else 'up to '}{facts.tokens_per_step:,}",
        (facts.resumed_from or 0) + 1,
        config.train.max_steps,
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

    @classmethod
    def of(
        cls,
        state: TrainState,
        facts: RunFacts,
        max_steps: int,
        save_seconds: list[float],
        guard: SpikeGuard | None,
        elapsed_s: float,
        tokens_per_s: float | None,
    ) -> TrainSummary:
        """The summary of a run at `state`, whose saves in this session took `save_seconds`,
        after `elapsed_s` seconds of training at `tokens_per_s` (None: no step this session)."""
        val = state.last_eval.get("val")
        repeated = ("run_dir", "n_params", "device", "dtype", "world_size", "rank", "resumed_from")
        return cls(
            **{name: getattr(facts, name) for name in repeated},
            step=state.step,
            max_steps=max_steps,
            tokens=state.tokens,
            elapsed_s=elapsed_s,
            train_loss=state.last_eval.get("train"),
            val_loss=val,
            val_ppl=perplexity(val) if val is not None else None,
            best_val_loss=state.best_val_loss if math.isfinite(state.best_val_loss) else None,
            tokens_per_s=tokens_per_s,
            saves=len(save_seconds),
            save_s=max(save_seconds, default=None),
            skipped=guard.state.skips if guard is not None else 0,
            rollbacks=guard.state.rollbacks if guard is not None else 0,
        )
