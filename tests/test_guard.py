"""The spike guard (`llmcli.training.guard`, `train.spike_guard`) and `train.log_layers`.

Poison comes from the training stream itself: a sampler that notes which batch of the stream it
drew, and a forward that multiplies that batch's loss, or turns the gradient through the logits
into NaN. Keyed by the sampler's batch count, the poison follows the stream across a resume.
"""

from __future__ import annotations

import json
import math
import signal
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import ROOT, assert_same_weights, make_config, stable_metrics, weights, write_config

import llmcli.objectives.base
from llmcli.config import config_from_dict
from llmcli.data.tokens import prepare_data
from llmcli.errors import ConfigError, InputError
from llmcli.model.gpt import Transformer
from llmcli.runs.directory import STATE_FILE
from llmcli.runs.formats import load_state, load_weights
from llmcli.runs.metrics import read_metrics
from llmcli.runs.trackers import tags
from llmcli.training.counters import TrainState
from llmcli.training.guard import DivergenceError, SpikeGuard
from llmcli.training.loop import train
from llmcli.training.optim import lr_at

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = 7  # make_config's train.seed: the training sampler's (evaluation's are offset from it)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text((ROOT / "data" / "shakespeare.txt").read_text(encoding="utf-8")[:30_000])
    return path


class Poison:
    """Which batches of the training stream are poisoned, and how."""

    def __init__(self, batches: set[int], how: str = "spike", drop: set[int] | None = None):
        self.batches, self.how = batches, how
        self.drop = drop or set()  # batches the training sampler skips (a run never seeing them)
        self.current: int | None = None  # the training batch being computed


@pytest.fixture
def poison(monkeypatch) -> Poison:
    state = Poison(set())
    real_sampler = llmcli.objectives.base.BatchSampler

    class StreamSampler(real_sampler):
        def __init__(self, *args, seed: int, **kwargs) -> None:
            super().__init__(*args, seed=seed, **kwargs)
            self.is_train = seed == SEED

        def next(self):
            if self.is_train and self.batches in state.drop:
                super().next()
            if self.is_train:
                state.current = self.batches
            return super().next()

    real_forward = Transformer.forward

    def forward(self, idx, targets=None, **kwargs):
        if torch.is_grad_enabled() and state.current in state.batches:
            if state.how == "nan_grad":
                hook = self.hooks({"final_norm": lambda t: _nan_gradient(t)})
                with hook:
                    return real_forward(self, idx, targets, **kwargs)
            logits, loss = real_forward(self, idx, targets, **kwargs)
            return logits, loss * 100.0
        return real_forward(self, idx, targets, **kwargs)

    monkeypatch.setattr(llmcli.objectives.base, "BatchSampler", StreamSampler)
    monkeypatch.setattr(Transformer, "forward", forward)
    return state


def _nan_gradient(t: torch.Tensor) -> torch.Tensor:
    """`t` unchanged going forward; the gradient flowing back through it becomes NaN."""
    t = t.clone()
    t.register_hook(lambda g: torch.full_like(g, math.nan))
    return t


def events(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "event"]


def train_losses(run_dir: Path) -> dict[int, float]:
    records = read_metrics(run_dir / "metrics.jsonl")
    return {r["step"]: r["train_loss"] for r in records if r.get("kind") == "train"}


# --- the guard's rule, against a recomputation ------------------------------------------------


def test_verdicts_follow_the_median_rule_and_count_skips_in_the_window() -> None:
    config = config_from_dict(
        {"train": {"spike_factor": 2.0, "spike_window": 5, "spike_skips": 3}}
    ).train
    guard = SpikeGuard(config, TrainState())
    rng = np.random.default_rng(0)
    losses = list(3.0 - 0.01 * np.arange(60) + rng.normal(0, 0.05, 60))
    for at in (12, 20, 31, 33, 34, 50):
        losses[at] *= 2.5
    losses[40] = math.nan
    applied: list[float] = []
    skipped: list[int] = []
    for i, loss in enumerate(losses):
        step = i + 1
        verdict = guard.check(step, loss, grad_norm=1.0)
        window = applied[-5:]
        spike = len(window) == 5 and loss > 2.0 * float(np.median(window))
        bad = not math.isfinite(loss) or spike
        assert (verdict.action == "apply") == (not bad), step
        if not bad:
            applied.append(loss)
            continue
        skipped = [s for s in skipped if s > step - 5] + [step]
        assert verdict.action == ("rollback" if len(skipped) >= 3 else "skip"), step
        assert verdict.event["median"] == (float(np.median(window)) if len(window) == 5 else None)
    assert guard.state.skips == 7 and guard.state.recent == applied[-5:]
    # A non-finite gradient norm is a skip whatever the loss.
    assert guard.check(61, 2.0, grad_norm=math.inf).event["reason"] == "gradient not finite"


def test_near_zero_loss_a_multiple_of_the_median_is_no_spike_under_the_margin() -> None:
    """A fine-tune that has learnt its task: losses of 0.01 to 0.03 are noise, not spikes; a
    jump past median + spike_margin still is one."""
    config = config_from_dict({"train": {"spike_window": 5, "spike_margin": 0.5}}).train
    guard = SpikeGuard(config, TrainState())
    for step, loss in enumerate([0.01, 0.012, 0.009, 0.011, 0.01, 0.03, 0.025], start=1):
        assert guard.check(step, loss, grad_norm=1.0).action == "apply", step
    median = float(np.median([0.009, 0.011, 0.01, 0.03, 0.025]))
    assert guard.check(8, median + 0.49, grad_norm=1.0).action == "apply"
    verdict = guard.check(9, median + 0.52, grad_norm=1.0)
    assert verdict.action == "skip" and verdict.event["reason"] == "loss above 2 x the median"


def test_a_loss_exactly_at_the_threshold_is_applied_and_one_ulp_above_is_skipped() -> None:
    """The rule is `loss > max(factor x median, median + margin)`: equal is no spike, on both
    sides of the max (values exact in binary, so the products and sums are exact)."""
    for median, margin, threshold in [(1.0, 0.5, 2.0), (0.25, 0.5, 0.75)]:
        config = config_from_dict(
            {"train": {"spike_factor": 2.0, "spike_window": 3, "spike_margin": margin}}
        ).train
        guard = SpikeGuard(config, TrainState())
        for step in (1, 2, 3):
            assert guard.check(step, median, grad_norm=1.0).action == "apply"
        assert guard.check(4, threshold, grad_norm=1.0).action == "apply", median
        above = math.nextafter(threshold, math.inf)
        assert guard.check(5, above, grad_norm=1.0).action == "skip", median


def test_the_factor_test_starts_once_the_window_is_full() -> None:
    config = config_from_dict({"train": {"spike_window": 3}}).train
    guard = SpikeGuard(config, TrainState())
    assert guard.check(1, 1.0, grad_norm=1.0).action == "apply"
    assert guard.check(2, 1.0, grad_norm=1.0).action == "apply"
    assert guard.check(3, 100.0, grad_norm=1.0).action == "apply"  # 2 losses seen: no median
    verdict = guard.check(4, 100.0, grad_norm=1.0)  # 3 seen: the median of [1, 1, 100] is 1
    assert verdict.action == "skip" and verdict.event["median"] == 1.0


def test_skips_count_within_the_last_spike_window_steps_only() -> None:
    """With a window of 5, a skip at step 6 still counts at step 10 (steps 6-10) and no longer
    at step 11 (steps 7-11)."""
    config = config_from_dict({"train": {"spike_window": 5, "spike_skips": 2}}).train
    for second, action in [(10, "rollback"), (11, "skip")]:
        guard = SpikeGuard(config, TrainState())
        for step in range(1, 6):
            assert guard.check(step, 1.0, grad_norm=1.0).action == "apply"
        assert guard.check(6, math.nan, grad_norm=1.0).action == "skip"
        for step in range(7, second):
            assert guard.check(step, 1.0, grad_norm=1.0).action == "apply"
        assert guard.check(second, math.nan, grad_norm=1.0).action == action, second


def test_a_rollback_lowers_the_rate_for_exactly_spike_lr_steps_steps() -> None:
    """Back to the save of step 10 (10 steps done), with spike_lr_steps 4: the 0-based steps
    10-13 run at the lowered rate, step 14 at the full one; the streak of rollbacks ends with
    the first step applied past them (1-based step 15, the 0-based step 14)."""
    config = config_from_dict(
        {"train": {"spike_window": 3, "spike_lr_steps": 4, "spike_lr_factor": 0.25}}
    ).train
    guard = SpikeGuard(config, TrainState())
    event = guard.rolled_back(step=12, to_step=10, loss=math.nan, saved=None)
    assert event["lr_until_step"] == 14 and guard.state.streak == 1
    assert [guard.lr_scale(s) for s in range(10, 16)] == [0.25, 0.25, 0.25, 0.25, 1.0, 1.0]
    for step in range(11, 15):  # 1-based steps 11-14: the 0-based steps 10-13
        assert guard.check(step, 1.0, grad_norm=1.0).action == "apply"
        assert guard.state.streak == 1, step
    assert guard.check(15, 1.0, grad_norm=1.0).action == "apply"
    assert guard.state.streak == 0


def test_guard_settings_out_of_range_name_the_key() -> None:
    for key, value in [
        ("spike_factor", 1.0),
        ("spike_window", 0),
        ("spike_skips", 0),
        ("spike_lr_factor", 0.0),
        ("spike_lr_factor", 1.5),
        ("spike_lr_steps", -1),
        ("spike_rollbacks", -1),
    ]:
        with pytest.raises(ConfigError, match=rf"train\.{key} \({value!r}\) must"):
            config_from_dict({"train": {key: value}})


# --- a poisoned batch ------------------------------------------------------------------------


def test_a_poisoned_batch_is_applied_without_the_guard(corpus, tmp_path, poison) -> None:
    poison.batches = {14}  # step 15, a log step
    run_dir = tmp_path / "run"
    train(make_config(corpus, spike_guard=False), out_dir=run_dir, progress=False)
    assert train_losses(run_dir)[15] > 100  # applied and logged: today's behaviour
    assert events(run_dir) == []


def test_a_poisoned_batch_is_skipped_as_if_the_stream_never_held_it(
    corpus, tmp_path, poison
) -> None:
    poison.batches = {14}
    guarded = tmp_path / "guarded"
    summary = train(make_config(corpus, spike_window=5), out_dir=guarded, progress=False)
    assert (summary.step, summary.skipped, summary.rollbacks) == (30, 1, 0)
    (event,) = events(guarded)
    assert event["event"] == "skipped" and event["step"] == 15
    assert event["reason"] == "loss above 2 x the median" and event["loss"] > 100
    assert train_losses(guarded)[15] < 10
    # The same run with that batch taken out of the stream, no poison: the same weights.
    poison.batches, poison.drop = set(), {14}
    clean = tmp_path / "clean"
    train(make_config(corpus, spike_window=5, log_interval=1), out_dir=clean, progress=False)
    assert events(clean) == []
    assert_same_weights(guarded, clean)
    losses = train_losses(clean)  # every step's: the median of steps 10-14 recomputed
    assert event["median"] == statistics.median(losses[s] for s in range(10, 15))


def test_an_injected_nan_gradient_stops_the_run_without_the_guard(corpus, tmp_path, poison) -> None:
    poison.batches, poison.how = {12}, "nan_grad"
    with pytest.raises(DivergenceError, match="nan at step 14"):
        train(make_config(corpus, spike_guard=False), out_dir=tmp_path / "run", progress=False)


def test_an_injected_nan_gradient_is_skipped_with_the_guard(corpus, tmp_path, poison) -> None:
    poison.batches, poison.how = {12}, "nan_grad"
    guarded = tmp_path / "guarded"
    summary = train(make_config(corpus), out_dir=guarded, progress=False)
    assert (summary.step, summary.skipped) == (30, 1)
    (event,) = events(guarded)
    assert (event["step"], event["reason"]) == (13, "gradient not finite")
    assert math.isfinite(event["loss"]) and math.isnan(event["grad_norm"])
    poison.batches, poison.drop = set(), {12}
    clean = tmp_path / "clean"
    train(make_config(corpus), out_dir=clean, progress=False)
    assert_same_weights(guarded, clean)


# --- rollback, and resume across it -----------------------------------------------------------

ROLLBACK = {"spike_window": 5, "spike_lr_steps": 5}


@pytest.fixture
def rolled_back(corpus, tmp_path_factory, poison) -> Path:
    """An uninterrupted run whose batches 14-16 are poisoned: three skips at step 15, a
    rollback to the save at step 10, then on with new batches at half the rate for 5 steps."""
    poison.batches = {14, 15, 16}
    run_dir = tmp_path_factory.mktemp("rollback") / "run"
    summary = train(make_config(corpus, **ROLLBACK), out_dir=run_dir, progress=False)
    assert (summary.step, summary.skipped, summary.rollbacks) == (30, 3, 1)
    return run_dir


def test_three_skips_roll_back_to_the_last_save_and_lower_the_rate(rolled_back, corpus) -> None:
    found = events(rolled_back)
    assert [(e["event"], e["step"]) for e in found] == [("skipped", 15)] * 3 + [("rollback", 15)]
    rollback = found[-1]
    assert (rollback["to_step"], rollback["rollback"], rollback["lr_until_step"]) == (10, 1, 15)
    records = [r for r in read_metrics(rolled_back / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30]  # each step once
    tc = make_config(corpus, **ROLLBACK).train
    lr = {r["step"]: r["lr"] for r in records}
    assert lr[15] == pytest.approx(lr_at(14, tc) * 0.5)  # 0-based step 14 < 10 + 5: lowered
    assert lr[20] == pytest.approx(lr_at(19, tc))
    state = load_state(rolled_back / STATE_FILE)
    assert state["guard"]["rollbacks"] == 1 and state["sampler"][0]["batches"] == 37


@pytest.mark.parametrize("kill", ["ctrl_c", "crash"])
def test_a_run_killed_after_the_rollback_resumes_bitwise(
    rolled_back, corpus, tmp_path, poison, kill, ctrl_c_raises
) -> None:
    poison.batches = {14, 15, 16}
    run_dir = tmp_path / "run"
    seen: list[int] = []

    def interrupt(step: int) -> None:
        seen.append(step)
        if seen.count(13) == 2:  # step 13 again, after the rollback
            if kill == "ctrl_c":
                signal.raise_signal(signal.SIGINT)  # saves step 13, then stops
            else:
                raise RuntimeError("killed")  # no save: the resume replays from step 10

    with pytest.raises(KeyboardInterrupt if kill == "ctrl_c" else RuntimeError):
        train(make_config(corpus, **ROLLBACK), out_dir=run_dir, progress=False, on_step=interrupt)
    assert load_state(run_dir / STATE_FILE)["step"] == (13 if kill == "ctrl_c" else 10)
    summary = train(make_config(corpus, **ROLLBACK), out_dir=run_dir, resume=True, progress=False)
    assert (summary.step, summary.skipped, summary.rollbacks) == (30, 3, 1)
    assert_same_weights(rolled_back, run_dir)
    assert stable_metrics(run_dir) == stable_metrics(rolled_back)


def test_a_run_that_cannot_recover_stops_saying_what_to_change(corpus, tmp_path, poison) -> None:
    poison.batches = set(range(14, 1000))  # every batch from step 15 on
    config = make_config(corpus, spike_window=5, spike_rollbacks=1)
    with pytest.raises(DivergenceError) as info:
        train(config, out_dir=tmp_path / "run", progress=False)
    message = str(info.value)
    assert isinstance(info.value, InputError)  # exit status 2
    assert "after 1 rollback(s) in a row (train.spike_rollbacks = 1)" in message
    assert "step 10" in message and "train.lr" in message and "check the data" in message
    assert [e["event"] for e in events(tmp_path / "run")] == ["skipped"] * 3 + ["rollback"] + [
        "skipped"
    ] * 3


def test_with_no_save_to_go_back_to_the_run_stops(corpus, tmp_path, poison) -> None:
    poison.batches, poison.how = {3, 4, 5}, "nan_grad"
    with pytest.raises(DivergenceError, match="no save yet to roll back to"):
        train(make_config(corpus), out_dir=tmp_path / "run", progress=False)


def test_train_command_counts_the_events_in_its_summary(corpus, tmp_path, poison, capsys) -> None:
    from llmcli.cli import main

    poison.batches = {14}
    config = write_config(make_config(corpus, spike_window=5), tmp_path / "c.yaml")
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(config), "--out", str(tmp_path / "run"), "--no-progress"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "spike guard: 1 step skipped, 0 rollbacks" in out


# --- train.log_layers ------------------------------------------------------------------------


def test_log_layers_match_a_hand_computation(corpus, tmp_path) -> None:
    """Each group's gradient norm (recomputed from the saved step-4 weights and the batch the
    sampler draws next) and its update ratio (from the step-4 and step-5 weights)."""
    constant = {"warmup_steps": 0, "min_lr": 1e-3, "lr": 1e-3, "log_interval": 5}
    five, four = tmp_path / "five", tmp_path / "four"
    train(
        make_config(corpus, max_steps=5, log_layers=True, **constant), out_dir=five, progress=False
    )
    config = make_config(corpus, max_steps=4, **constant)
    train(config, out_dir=four, progress=False)
    (record,) = [r for r in read_metrics(five / "metrics.jsonl") if r["kind"] == "train"]
    layers = record["layers"]
    assert list(layers) == ["embed", "blocks.0", "final"]

    def group(name: str) -> str:
        if name.startswith("blocks.0."):
            return "blocks.0"
        return "embed" if name.split(".")[0] in ("wte", "wpe") else "final"

    before, after = weights(four), weights(five)
    for g in layers:
        names = [n for n in before if group(n) == g]
        change = np.sqrt(sum(((after[n] - before[n]).double() ** 2).sum().item() for n in names))
        size = np.sqrt(sum((before[n].double() ** 2).sum().item() for n in names))
        assert layers[g]["update_ratio"] == pytest.approx(change / size, rel=1e-4)

    # The gradient of step 5, by hand: the step-4 weights on the batch the sampler draws next.
    model = Transformer(config.model, vocab_size=before["wte.weight"].shape[0])
    load_weights(model, before, four / "model.safetensors")
    sampler = llmcli.objectives.base.BatchSampler(
        prepare_data(config.data, config.model.context_length).train,
        config.train.batch_size,
        config.model.context_length,
        seed=SEED,
    )
    sampler.load_state_dict(load_state(four / STATE_FILE)["sampler"][0])
    _, loss = model(*sampler.next())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for g in layers:
        norm = np.sqrt(sum((grads[n].double() ** 2).sum().item() for n in grads if group(n) == g))
        assert layers[g]["grad_norm"] == pytest.approx(norm, rel=1e-4)
    total = math.sqrt(sum(v["grad_norm"] ** 2 for v in layers.values()))
    assert total == pytest.approx(record["grad_norm"], rel=1e-5)
    assert tags(record)["layers/blocks.0/update_ratio"] == layers["blocks.0"]["update_ratio"]
    assert json.dumps(record)  # plain JSON


def test_events_reach_the_trackers_under_their_own_tags() -> None:
    skipped = {"kind": "event", "event": "skipped", "step": 15, "loss": 301.5, "grad_norm": 9.0}
    rollback = {"kind": "event", "event": "rollback", "step": 15, "loss": 250.0, "rollback": 2}
    assert tags(skipped) == {"guard/skipped_loss": 301.5}  # not train/grad_norm: no step was made
    assert tags(rollback) == {"guard/rollback_loss": 250.0, "guard/rollbacks": 2.0}
