"""train.compile: auto's rule against a hand computation, the cache kept on disk, and a resumed
run keeping its start's choice."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import small_run_config

from llmcli.config import config_from_dict
from llmcli.training import compiling
from llmcli.training.compiling import (
    CACHE_ENV,
    COLD_S,
    RECORD,
    SAVING,
    WARM_S,
    choose,
    inductor_cache,
    pays,
    remember,
    step_key,
)
from llmcli.training.loop import train


def test_auto_compiles_when_the_steps_left_save_more_than_the_warm_up() -> None:
    cases = [(0.05, 2000, True, "cpu"), (1.2, 5000, False, "cpu"), (1.2, 5000, True, "cpu")]
    cases += [(0.05, 2000, False, "cuda"), (0.05, 20000, False, "cuda"), (1.0, 10**6, True, "mps")]
    for step_s, steps, warm, device in cases:
        saved = SAVING.get(device, 0.0) * step_s * steps  # by hand
        expected = saved > (WARM_S if warm else COLD_S)
        choice = pays(step_s, steps, warm, device)
        assert choice.compile is expected, (step_s, steps, warm, device)
        assert ("compiles" if expected else "stays eager") in choice.reason
    # On 2 CPU cores compiling saves about 1%: tiny's 2,000 steps never pay for it.
    assert not pays(0.05, 2000, True, "cpu").compile
    assert pays(1.2, 5000, True, "cpu").compile  # the small config's run, its graphs cached


def test_true_and_false_are_kept_and_a_resumed_run_keeps_its_choice(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    never = lambda: pytest.fail("measured a step it did not need")  # noqa: E731
    assert choose(True, "k", 10, never).compile is True
    assert choose(False, "k", 10**9, never).compile is False
    assert choose("auto", "k", 10**9, never, resumed=False).compile is False
    assert choose("auto", "k", 1, never, resumed=True).compile is True
    assert choose("auto", "k", 0, never).compile is False
    # Measured: 1.2 s a step over 500 steps pays a warm cache's warm-up only (on CUDA).
    assert choose("auto", "k", 500, lambda: 0.05, device="cuda").compile is False
    remember(tmp_path, "k")
    assert json.loads((tmp_path / RECORD).read_text()) == ["k"]
    assert choose("auto", "k", 500, lambda: 0.05, device="cuda").compile is True
    assert choose("auto", "other", 500, lambda: 0.05, device="cuda").compile is False
    assert choose("auto", "k", 10**9, never, device="mps").compile is False


def test_the_inductor_cache_is_llmclis_unless_the_user_set_one(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("LLMCLI_CACHE", str(tmp_path / "llmcli"))
    assert inductor_cache() == tmp_path / "llmcli" / "inductor"
    assert os.environ[CACHE_ENV] == str(tmp_path / "llmcli" / "inductor")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert inductor_cache() == tmp_path / "mine"


def test_the_key_changes_with_what_changes_the_graphs() -> None:
    config = config_from_dict({"model": {"n_layer": 2}})
    cpu = torch.device("cpu")
    key = step_key(config, 65, cpu)
    assert key == step_key(config_from_dict({"model": {"n_layer": 2}}), 65, cpu)
    assert key != step_key(config, 66, cpu)
    assert key != step_key(config_from_dict({"model": {"n_layer": 3}}), 65, cpu)
    bigger = config_from_dict({"model": {"n_layer": 2}, "train": {"batch_size": 64}})
    assert key != step_key(bigger, 65, cpu)


@pytest.mark.usefixtures("one_thread")
def test_a_resumed_auto_run_keeps_the_choice_its_meta_records(small_corpus, tmp_path, monkeypatch):
    """The choice written at the start is what the resumed run uses: it does not decide again
    (compiled and eager steps round differently, so a resume must not switch)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "inductor"))
    raw = small_run_config(small_corpus, max_steps=4, eval_interval=4, eval_steps=1)
    raw["train"]["compile"] = "auto"
    train(config_from_dict(raw), out_dir=tmp_path / "run", progress=False)
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["compiled"] is False  # 4 steps pay no warm-up
    monkeypatch.setattr(compiling, "pays", lambda *a: pytest.fail("a resumed run decided again"))
    raw["train"]["max_steps"] = 8
    train(config_from_dict(raw), out_dir=tmp_path / "run", resume=True, progress=False)
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert (meta["step"], meta["compiled"]) == (8, False)
