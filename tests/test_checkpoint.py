"""Saving, restoring and rolling back a training run (llmcli/training/checkpoint.py), on runs
built as `llmcli train` builds them (`llmcli.training.build`): what a save writes against the
run it saves, a save put back into a fresh run, a rollback in the middle of one, and the stop.
(Whole runs resumed bitwise: tests/test_train.py, tests/test_guard.py, tests/test_crash.py.)"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import small_run_config

from llmcli.config import config_from_dict
from llmcli.runs.directory import META_FILE, METRICS_FILE, STATE_FILE
from llmcli.runs.formats import load_state, read_weights
from llmcli.training.build import Run, started
from llmcli.training.guard import DivergenceError, Verdict
from llmcli.training.interrupt import Preempted
from llmcli.training.log import TrainLog
from llmcli.training.precision import Precision
from llmcli.training.step import train_step

pytestmark = pytest.mark.usefixtures("one_thread")


def raw(corpus: Path, **train) -> dict:
    return small_run_config(corpus, max_steps=20, eval_interval=5, eval_steps=1, **train)


def steps(run: Run, n: int) -> None:
    """`n` steps as the loop takes them, the counters moved on."""
    for _ in range(n):
        train_step(run.trainer)
        run.state.step += 1
        run.state.tokens += run.facts.tokens_per_step


def weights(run: Run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.model.state_dict().items()}


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def test_a_save_writes_the_counters_the_facts_and_every_log_size(small_corpus, tmp_path) -> None:
    config = config_from_dict(raw(small_corpus, head_metrics=True))
    with started(config, tmp_path / "run", False, False) as run:
        with TrainLog.open(run.config, run.data, run.facts, main=True) as log:
            steps(run, 3)
            log.train_step(run.state, 1e-3, 2.5, 100.0, torch.tensor(0.5), None)
            log.heads.write({"step": 3, "induction": [[0.1]]})
            run.checkpoints.save(run.state, run.config, log, best=True)
            sizes = log.sizes()
    run_dir = tmp_path / "run"
    meta = json.loads((run_dir / META_FILE).read_text())
    facts = run.facts
    assert (meta["step"], meta["tokens"], meta["max_steps"]) == (3, 3 * facts.tokens_per_step, 20)
    assert (meta["vocab_size"], meta["n_params"]) == (facts.vocab_size, facts.n_params)
    assert (meta["device"], meta["dtype"], meta["world_size"]) == ("cpu", "float32", 1)
    assert meta["compiled"] is False and meta["config_name"] == config.name
    saved = load_state(run_dir / STATE_FILE)
    assert (saved["metrics_bytes"], saved["head_metrics_bytes"]) == sizes
    assert sizes[0] == (run_dir / METRICS_FILE).stat().st_size > 0
    for name in ("model.safetensors", "best.safetensors"):
        tensors, _ = read_weights(run_dir / name)
        assert all(torch.equal(tensors[k], v) for k, v in weights(run).items() if k in tensors)
    assert run.state.last_saved == 3 and len(run.checkpoints.save_seconds) == 1


def test_a_save_restored_into_a_fresh_run_goes_on_as_the_run_saved(small_corpus, tmp_path) -> None:
    config = config_from_dict(raw(small_corpus))
    run_dir = tmp_path / "run"
    with started(config, run_dir, False, False) as run:
        with TrainLog.open(run.config, run.data, run.facts, main=True) as log:
            steps(run, 4)
            run.checkpoints.save(run.state, run.config, log, best=False)
            steps(run, 3)  # the uninterrupted run, from the save on
            after = weights(run)
            draws = (torch.rand(3), np.random.rand(), random.random())
    with started(config, run_dir, True, False) as resumed:
        assert resumed.facts.resumed_from == 4 and resumed.state.step == 4
        assert resumed.facts.metrics_bytes == load_state(run_dir / STATE_FILE)["metrics_bytes"]
        steps(resumed, 3)
        assert all(torch.equal(after[k], v) for k, v in weights(resumed).items())
        assert torch.equal(draws[0], torch.rand(3)) and draws[1:] == (
            np.random.rand(),
            random.random(),
        )
        assert resumed.state.tokens == run.state.tokens


def test_dropout_after_a_resume_draws_from_the_saved_torch_generator(
    small_corpus, tmp_path
) -> None:
    """Dropout's masks come from torch's global generator, which the steps move on: a resume
    that reseeded it instead of putting the save's state back would draw other masks."""
    raw_config = raw(small_corpus)
    raw_config["model"]["dropout"] = 0.2
    config = config_from_dict(raw_config)
    run_dir = tmp_path / "run"
    with started(config, run_dir, False, False) as run:
        with TrainLog.open(run.config, run.data, run.facts, main=True) as log:
            steps(run, 3)
            run.checkpoints.save(run.state, run.config, log, best=False)
            steps(run, 2)
            after = weights(run)
    with started(config, run_dir, True, False) as resumed:
        steps(resumed, 2)
        assert all(torch.equal(after[k], v) for k, v in weights(resumed).items())


def test_a_resume_puts_back_every_counter(small_corpus, tmp_path) -> None:
    config = config_from_dict(raw(small_corpus))
    run_dir = tmp_path / "run"
    with started(config, run_dir, False, False) as run:
        with TrainLog.open(run.config, run.data, run.facts, main=True) as log:
            steps(run, 3)
            state = run.state
            state.elapsed_base = 1000.0  # as if earlier sessions had trained for 1000 s
            state.record_eval({"train": 2.5, "val": 2.75})  # step 3's evaluation, the best
            run.checkpoints.save(state, run.config, log, best=False)
            saved_elapsed = load_state(run_dir / STATE_FILE)["elapsed_s"]
    with started(config, run_dir, True, False) as resumed:
        got = resumed.state
        assert (got.step, got.tokens, got.last_saved) == (3, state.tokens, 3)
        assert (got.best_val_loss, got.best_step) == (2.75, 3)
        assert got.last_eval == {"train": 2.5, "val": 2.75}
        assert got.elapsed_base == saved_elapsed and 1000.0 < saved_elapsed < got.elapsed


def test_a_resume_takes_todays_learning_rate_and_decay_with_the_saved_moments(
    small_corpus, tmp_path
) -> None:
    """The optimizer's moments come from the save, its hyperparameters from the config the
    run resumes with (`--set train.lr=...`), not from the save's param groups."""
    run_dir = tmp_path / "run"
    with started(config_from_dict(raw(small_corpus)), run_dir, False, False) as run:
        with TrainLog.open(run.config, run.data, run.facts, main=True) as log:
            steps(run, 2)
            run.checkpoints.save(run.state, run.config, log, best=False)
            moments = {id(p): run.trainer.optimizer.state[p] for p in run.model.parameters()}
            names = {id(p): n for n, p in run.model.named_parameters()}
            saved_moments = {names[i]: m["exp_avg"].clone() for i, m in moments.items()}
    today = config_from_dict(raw(small_corpus, lr=0.02, weight_decay=0.25, beta2=0.9))
    with started(today, run_dir, True, False) as resumed:
        optimizer = resumed.trainer.optimizer
        decay, no_decay = optimizer.param_groups
        assert (decay["base_lr"], decay["weight_decay"], decay["betas"]) == (0.02, 0.25, (0.9, 0.9))
        assert (no_decay["base_lr"], no_decay["weight_decay"]) == (0.02, 0.0)
        for name, p in resumed.model.named_parameters():
            assert torch.equal(optimizer.state[p]["exp_avg"], saved_moments[name]), name


def test_a_resume_puts_back_the_loss_scale(small_corpus, tmp_path, monkeypatch) -> None:
    """fp16's GradScaler (here on the CPU, over float32 maths) doubles its scale every 2 steps
    without an overflow: a resume goes on from the save's scale and count, not a fresh one."""

    def scaled(cls, device, dtype):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        return Precision("float32", device, None, scaler)

    monkeypatch.setattr(Precision, "resolve", classmethod(scaled))
    config = config_from_dict(raw(small_corpus))
    run_dir = tmp_path / "run"
    with started(config, run_dir, False, False) as run:
        with TrainLog.open(run.config, run.data, run.facts, main=True) as log:
            steps(run, 3)
            assert run.trainer.precision.scaler.get_scale() == 2.0**11
            run.checkpoints.save(run.state, run.config, log, best=False)
            steps(run, 1)  # the 4th step without an overflow doubles it again
            assert run.trainer.precision.scaler.get_scale() == 2.0**12
    with started(config, run_dir, True, False) as resumed:
        assert resumed.trainer.precision.scaler.get_scale() == 2.0**11
        steps(resumed, 1)
        assert resumed.trainer.precision.scaler.get_scale() == 2.0**12


def test_a_resume_judges_the_next_step_against_the_saved_loss_window(
    small_corpus, tmp_path
) -> None:
    """The spike guard's window of recent losses is part of the save: a resumed run skips a
    spike at once, where a fresh window (not yet full) would apply it."""
    config = config_from_dict(raw(small_corpus, spike_guard=True, spike_window=3))
    run_dir = tmp_path / "run"
    with started(config, run_dir, False, False) as run:
        with TrainLog.open(run.config, run.data, run.facts, main=True) as log:
            for step in (1, 2, 3):
                assert run.guard.check(step, 2.0, grad_norm=1.0).action == "apply"
            run.checkpoints.save(run.state, run.config, log, best=False)
    with started(config, run_dir, True, False) as resumed:
        assert resumed.guard.state.recent == [2.0, 2.0, 2.0]
        assert resumed.guard.check(4, 50.0, grad_norm=1.0).action == "skip"


def test_a_rollback_goes_back_to_the_save_and_keeps_the_events_and_the_clock(
    small_corpus, tmp_path
) -> None:
    config = config_from_dict(raw(small_corpus, spike_guard=True))
    with started(config, tmp_path / "run", False, False) as run:
        with TrainLog.open(run.config, run.data, run.facts, main=True) as log:
            steps(run, 2)
            log.train_step(run.state, 1e-3, 2.5, 100.0, torch.tensor(0.5), None)
            run.checkpoints.save(run.state, run.config, log, best=False)
            saved, saved_tokens = weights(run), run.state.tokens
            steps(run, 3)
            log.train_step(run.state, 1e-3, 9.5, 100.0, torch.tensor(0.5), None)
            skip = {"kind": "event", "event": "skipped", "step": 6, "loss": 9.0}
            log.event(skip, "step 6 skipped")
            elapsed = run.state.elapsed
            event = run.checkpoints.rollback(run.state, log, 6, 9.0)
            assert (run.state.step, run.state.tokens) == (2, saved_tokens)
            assert run.state.elapsed >= elapsed  # the clock runs on
            assert all(torch.equal(saved[k], v) for k, v in weights(run).items())
    assert (event["event"], event["to_step"], event["rollback"]) == ("rollback", 2, 1)
    assert [(r["kind"], r["step"]) for r in records(tmp_path / "run")] == [
        ("train", 2),
        ("event", 6),
    ]


def test_a_refused_step_is_skipped_rolled_back_or_stops_the_run(small_corpus, tmp_path) -> None:
    config = config_from_dict(raw(small_corpus, spike_guard=True))
    with started(config, tmp_path / "run", False, False) as run:
        with TrainLog.open(run.config, run.data, run.facts, main=True) as log:
            guard, checkpoints, state = run.guard, run.checkpoints, run.state
            event = {"kind": "event", "event": "skipped", "step": 3, "loss": 8.0, "reason": "r"}
            guard.verdict = Verdict("skip", event)
            assert checkpoints.refused(state, log, run.divergence) is False
            guard.verdict = Verdict("rollback", event)  # with no save to go back to: a stop
            with pytest.raises(DivergenceError, match="no save yet to roll back to"):
                checkpoints.refused(state, log, run.divergence)
            steps(run, 2)
            checkpoints.save(state, run.config, log, best=False)
            steps(run, 1)
            assert checkpoints.refused(state, log, run.divergence) is True
            assert state.step == 2 and guard.state.rollbacks == 1
    kinds = [(r["event"], r["step"]) for r in records(tmp_path / "run")]
    assert kinds == [("skipped", 3), ("skipped", 3), ("skipped", 3), ("rollback", 3)]


@pytest.mark.parametrize("preempted", [False, True])
def test_the_stop_leaves_the_loop_with_the_exception_its_signal_asks_for(
    small_corpus, tmp_path, preempted
) -> None:
    config = config_from_dict(raw(small_corpus))
    with started(config, tmp_path / "run", False, False) as run:
        with TrainLog.open(run.config, run.data, run.facts, main=True):
            steps(run, 2)
            with pytest.raises(KeyboardInterrupt) as stopped:
                run.checkpoints.stop(run.state, preempted)
            assert isinstance(stopped.value, Preempted) is preempted
    assert run.checkpoints.save_seconds == []  # the loop saves before it stops


def test_divergence_names_the_last_good_checkpoint(small_corpus, tmp_path) -> None:
    config = config_from_dict(raw(small_corpus))
    with started(config, tmp_path / "run", False, False) as run:
        run.divergence.check([2.0, 1.5], 1, -1)  # finite: nothing happens
        with pytest.raises(DivergenceError) as info:
            run.divergence.check([2.0, math.nan], 7, 5)
    message = str(info.value)
    assert message.startswith("the loss became nan at step 8: training diverged")
    assert f"the last good checkpoint (step 5) in '{tmp_path / 'run'}' is intact" in message
    lr = config.train.lr
    assert f"(train.lr = {lr:g}; try --set train.lr={lr / 3:.3g})" in message
