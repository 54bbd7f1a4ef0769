"""Saving a training run, restoring a save into it, and rolling back to the last one.

A save (`Checkpointer.save`) writes the weights, `meta.json` and the resume state through
`llmcli.runs.directory.save_checkpoint`: every file to a temporary name renamed into place,
`state.pt` last as the save's commit point. It holds every rank's RNG and batch-sampler states
(gathered to rank 0, which alone writes), so a resumed run goes on exactly
(`llmcli.training.state`).
`restore` puts a save back into a freshly built run (`--resume`); `Checkpointer.rollback` puts
the last save back in the middle of a run for the spike guard (`llmcli.training.guard`), through
the same path, leaving the batch sampler and the random streams where they are.

What `meta.json` records beyond the counters is fixed when the run is built
(`llmcli.training.run_facts.RunFacts`).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from llmcli.config import Config
from llmcli.hf.lora import adapter_layout, peft_adapter_files
from llmcli.model.lora import adapted_layers, adapter_state_dict, merged_state_dict
from llmcli.runs.directory import BEST_ADAPTER_FILE, STATE_FILE, save_checkpoint
from llmcli.runs.formats import load_weights, weights_bytes
from llmcli.runs.versions import record as record_versions
from llmcli.training.counters import TrainState
from llmcli.training.distributed import DistInfo, agreed, gather
from llmcli.training.guard import Divergence, SpikeGuard
from llmcli.training.interrupt import Preempted
from llmcli.training.log import TrainLog
from llmcli.training.rng import rng_state, set_rng_state
from llmcli.training.run_facts import RunFacts
from llmcli.training.state import ResumeState
from llmcli.training.step import Trainer

logger = logging.getLogger(__name__)


class Checkpointer:
    """Saves a run's checkpoints (rank 0 writes, every rank takes part) and rolls the run back
    to its last save.

    Args:
        facts: what the run is (`meta.json`'s fixed fields, the run directory).
        info: this process's place under torchrun.
        model: the model, unwrapped: its weights are saved.
        trainer: its optimizer, precision scaler and batch sampler are saved.
        guard: the spike guard, whose state is saved (None without it).
    """

    def __init__(
        self,
        facts: RunFacts,
        info: DistInfo,
        model: Any,
        trainer: Trainer,
        guard: SpikeGuard | None,
    ) -> None:
        self.facts, self.info, self.model = facts, info, model
        self.trainer, self.guard = trainer, guard
        self.saved_at = time.perf_counter()  # the end of the last save, or the run's start
        self.save_seconds: list[float] = []  # this session's saves

    @property
    def run_dir(self) -> Path:
        return self.facts.run_dir

    def due_by_clock(self, interval_s: float | None) -> bool:
        """Whether `train.save_interval_s` seconds have passed since the last save."""
        return interval_s is not None and time.perf_counter() - self.saved_at >= interval_s

    def save(self, state: TrainState, config: Config, log: TrainLog, best: bool) -> None:
        """Write a checkpoint of step `state.step` (rank 0), with every rank's RNG and sampler
        state and the size of every log (`log`); `best` also writes the weights to
        `best.safetensors`."""
        start = time.perf_counter()
        device = self.trainer.precision.device
        rngs_and_samplers = gather(
            (rng_state(device), self.trainer.batches.state_dict()), self.info
        )
        if self.info.main:
            save_checkpoint(
                self.run_dir,
                self._weights(),
                self._resume_state(state, config, log, rngs_and_samplers).to_dict(),
                self._meta(state, config),
                best=best,
                previous_step=state.last_saved,
                extra_files=self._adapter_files(config, state.step, best),
            )
        state.last_saved = state.step
        self.saved_at = time.perf_counter()
        self.save_seconds.append(self.saved_at - start)

    def _weights(self) -> Any:
        """What `model.safetensors` gets: the model, or a LoRA run's merged weights (readers
        see the plain model it equals; the adapters themselves are in the resume state)."""
        if any(True for _ in adapted_layers(self.model)):
            return merged_state_dict(self.model)
        return self.model

    def _adapter_files(self, config: Config, step: int, best: bool) -> dict[str, bytes]:
        """A LoRA run's adapters in PEFT's format (`llmcli.hf.lora`), in the layout of the
        architecture the run exports as, and at a best step also in `best_adapter.safetensors`
        (the export's base + adapter of `--weights best`); none for a full fine-tune, or
        adapters PEFT's format cannot hold (an untied LM head's new token rows)."""
        counts = self.facts.meta_rows.get("lora")  # (`lora_meta`: the model's adapters)
        arch = adapter_layout(self.model, config.model) if counts else None
        lora, base_vocab = config.train.lora, counts["base_vocab_size"] if counts else 0
        if arch is None or lora is None:  # (adapters come from train.lora)
            return {}
        files = peft_adapter_files(self.model, lora, arch, config.train.init_from, base_vocab)
        if best:
            files[BEST_ADAPTER_FILE] = weights_bytes(adapter_state_dict(self.model), {"step": step})
        return files

    def _resume_state(
        self,
        state: TrainState,
        config: Config,
        log: TrainLog,
        rngs_and_samplers: list[tuple[Any, Any]],
    ) -> ResumeState:
        """What `state.pt` holds: the counters, the logs' sizes, weights, optimizer and
        precision state, and every rank's RNG and sampler states (`rngs_and_samplers`, in rank
        order)."""
        trainer = self.trainer
        metrics_bytes, head_metrics_bytes = log.sizes()
        return ResumeState(
            counters=state,
            metrics_bytes=metrics_bytes,
            head_metrics_bytes=head_metrics_bytes,
            vocab_size=self.facts.vocab_size,
            source_hash=self.facts.source_hash,
            config=config.to_dict(),
            model=self.model.state_dict(),
            optimizer=trainer.optimizer.state_dict(),
            scaler=trainer.precision.scaler.state_dict(),
            rng=[rng for rng, _ in rngs_and_samplers],
            sampler=[sampler for _, sampler in rngs_and_samplers],
            guard=self.guard.state_dict() if self.guard is not None else None,
        )

    def _meta(self, state: TrainState, config: Config) -> dict[str, Any]:
        """`meta.json`: the counters at this save, the versions, and the run's facts."""
        facts = self.facts
        meta = {
            "step": state.step,
            "max_steps": config.train.max_steps,
            "tokens": state.tokens,
            "elapsed_s": round(state.elapsed, 3),
            "best_val_loss": finite_or_none(state.best_val_loss),
            "best_step": state.best_step,
            "last_eval": state.last_eval,
            "vocab_size": facts.vocab_size,
            "n_params": facts.n_params,
            "device": facts.device,
            "dtype": facts.dtype,
            "world_size": facts.world_size,
            "versions": record_versions(),
            # the shipped config's name finds the run's reference curve (llmcli.runs.reference)
            "config_name": facts.config_name,
            "tokenizer_training": facts.tokenizer_training,
            "compiled": facts.compiled,  # train.compile's choice, which a resumed run keeps
            # what a log step's `mfu` divides by (llmcli.training.mfu)
            "flops_per_token": facts.flops_per_token,
            "peak_flops": facts.peak_flops,
        }
        return meta | facts.meta_rows  # how many examples fit; a LoRA run's parameters

    def rollback(self, state: TrainState, log: TrainLog, step: int, loss: float) -> dict[str, Any]:
        """The spike guard's rollback at step `step`: back to the last save, read as a resume
        reads it, with the sampler and the random streams left where they are (past the
        batches that caused it) and the clock still running; `state` is changed in place, the
        logs cut back to the save, keeping their event records. Returns the rollback's event
        record."""
        assert self.guard is not None
        with agreed(self.info, self.trainer.precision.device):
            saved = ResumeState.load(self.run_dir)
        restore_training(saved, self.model, self.trainer)
        state.take(saved.counters, but=("elapsed_base", "session_start"))  # the clock runs on
        log.rewind(saved.metrics_bytes, saved.head_metrics_bytes)
        guard, to_step, events = self.guard, state.step, []
        saved.load_part(
            "guard", lambda: events.append(guard.rolled_back(step, to_step, loss, saved.guard))
        )
        return events[0]

    def refused(self, state: TrainState, log: TrainLog, divergence: Divergence) -> bool:
        """After the spike guard refused a step: log the skip, and roll the run back to its
        last save when the guard says so (True), or stop it (`DivergenceError`) when it
        cannot recover."""
        guard = self.guard
        assert guard is not None and guard.verdict is not None
        event = guard.verdict.event
        assert event is not None
        step, loss = event["step"], event["loss"]
        log.event(event, f"step {step} skipped ({event['reason']}, loss {loss:.4g})")
        can_roll_back = state.last_saved >= 0
        if guard.verdict.action == "rollback" and can_roll_back:
            back = self.rollback(state, log, step, loss)
            log.event(
                back,
                f"rolled back to step {back['to_step']} (rollback {back['rollback']}): learning "
                f"rate x {back['lr_factor']:g} until step {back['lr_until_step']}, on new batches",
            )
            return True
        if guard.verdict.action != "skip":
            what = guard.stop_advice(event, can_roll_back)
            raise divergence.error(what, state.last_saved)
        return False

    def stop(self, state: TrainState, preempted: bool) -> None:
        """Leave the run, saved at this step, with KeyboardInterrupt, or `Preempted` (its
        subclass) after SIGTERM."""
        if self.info.main:
            logger.warning(
                "stopped at step %d; the checkpoint in '%s' is saved: "
                "continue with the same command and --resume (or --resume auto)",
                state.step,
                self.run_dir,
            )
        raise Preempted if preempted else KeyboardInterrupt

    def quit_message(self, state: TrainState) -> str:
        """What quitting at once (a second Ctrl-C) now keeps and loses."""
        step, last_saved = state.step, state.last_saved
        if last_saved < 0:
            return (
                f"quitting without saving: no checkpoint was saved yet, so the {step} steps of "
                "this run are lost (a run saves at each evaluation, train.eval_interval)"
            )
        lost = f"steps {last_saved + 1}-{step} are lost" if step > last_saved else "nothing is lost"
        return (
            f"quitting without saving: the checkpoint of step {last_saved} in '{self.run_dir}' "
            f"is kept (continue with --resume); {lost}"
        )


def restore(
    saved: ResumeState,
    state: TrainState,
    model: Any,
    trainer: Trainer,
    guard: SpikeGuard | None,
    info: DistInfo,
) -> None:
    """Put a save back into a freshly built run (`--resume`): weights, optimizer moments (with
    today's hyperparameters), precision scaler, spike guard, this rank's RNG and sampler states,
    and the counters into `state` (in place: the guard holds it), this session's time still
    counted from its start.

    Raises:
        CheckpointError: a part that does not fit this run (a damaged or foreign file),
            naming the file and the part.
    """
    saved.check_parts(model, trainer.optimizer)  # all of it, before any is loaded
    restore_training(saved, model, trainer)
    if guard is not None and saved.guard is not None:  # else a fresh guard: an empty window
        saved.load_part("guard", lambda: guard.load_state_dict(saved.guard))
    saved_world = len(saved.rng)
    if saved_world != info.world_size and info.main:
        logger.warning(
            "resuming a %d-process run with %d processes: batches and random "
            "numbers will differ from an uninterrupted run",
            saved_world,
            info.world_size,
        )
    own = min(info.rank, saved_world - 1)
    device = trainer.precision.device
    saved.load_part("rng", lambda: set_rng_state(saved.rng[own], device))
    saved.load_part("sampler", lambda: trainer.batches.load_state_dict(saved.sampler[own]))
    state.take(saved.counters, but=("session_start",))


def restore_training(saved: ResumeState, model: Any, trainer: Trainer) -> None:
    """Put back what a step changes: the weights, the optimizer's moments and step counts
    (with today's hyperparameters) and the precision scaler."""
    load_weights(model, saved.model, saved.path or STATE_FILE)
    optimizer = trainer.optimizer
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    saved.load_part("optimizer", lambda: optimizer.load_state_dict(saved.optimizer))
    for group, values in zip(optimizer.param_groups, fresh, strict=True):
        group.update(values)
    if saved.scaler:  # {}: saved without loss scaling (fp32, bf16); a fresh scale here
        scaler = trainer.precision.scaler
        saved.load_part("scaler", lambda: scaler.load_state_dict(saved.scaler))


def finite_or_none(value: float) -> float | None:
    """`value`, or None for an infinity or NaN (JSON has neither)."""
    return value if math.isfinite(value) else None
