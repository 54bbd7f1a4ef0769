"""`llmcli plan` (llmcli/training/plan.py, llmcli/cli/plan.py): the counts against the built
model and the textbook formulas, the memory against `estimate_memory`, the timing, the JSON
fields, and a config whose data is missing."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import yaml
from conftest import small_run_config

from llmcli.cli import main
from llmcli.config import config_from_dict
from llmcli.data.tokens import prepare_data
from llmcli.model.gpt import Transformer
from llmcli.training.memory import estimate_memory
from llmcli.training.plan import ASSUMED_VOCAB, format_plan, make_plan

pytestmark = pytest.mark.usefixtures("one_thread")

JSON_FIELDS = {
    "params",
    "params_non_embedding",
    "flops_per_token",
    "tokens_per_step",
    "memory",
    "device_free",
    "fits",
    "step_s",
    "eta_s",
}


def _raw(corpus: Path, **train: object) -> dict:
    raw = small_run_config(corpus, max_steps=100, eval_interval=30, eval_steps=5, **train)
    raw["model"].update(n_layer=2, n_embed=32, tie_embeddings=False)
    return raw


def test_plan_counts_the_built_model_and_the_formulas(small_corpus: Path) -> None:
    config = config_from_dict(_raw(small_corpus, grad_accum=3, memory_limit="1GiB"))
    plan = make_plan(config, "cpu")
    vocab = prepare_data(config.data, 16).tokenizer.vocab_size
    model = Transformer(config.model, vocab)
    named = dict(model.named_parameters())
    n = sum(p.numel() for p in named.values())
    embeddings = named["wte.weight"].numel() + named["wpe.weight"].numel()  # untied: lm_head stays
    L, T, C = 2, 16, 32
    assert plan.vocab_size == vocab and plan.missing is None
    assert plan.memory == estimate_memory(config, vocab, "cpu", "float32")
    got = plan.to_json()
    assert set(got) == JSON_FIELDS
    assert got["params"] == n and got["params_non_embedding"] == n - embeddings
    assert got["flops_per_token"] == 6 * (n - embeddings) + 12 * L * T * C
    assert got["tokens_per_step"] == 4 * T * 3
    assert got["memory"] == {
        "weights": 4 * n,
        "grads": 4 * n,
        "optimizer": 8 * n,
        "activations": plan.memory.activations,
        "peak": 16 * n + plan.memory.activations + plan.memory.runtime,
    }
    assert got["device_free"] == 2**30 and got["fits"] is True
    timing = plan.timing
    assert timing is not None and timing.steps >= 1 and timing.batch == 4
    assert 0 < timing.forward_s < timing.step_s
    evals = 4  # steps 30, 60, 90 and the last, 100
    eta = timing.step_s * 100 + evals * 2 * 5 * timing.forward_s
    assert got["eta_s"] == pytest.approx(eta, abs=1e-3)
    text = format_plan(plan)
    assert f"{n:,} ({n - embeddings:,} without embeddings" in text
    assert f"{4 * T * 3:,} (4 sequences x 16 tokens x grad_accum 3)" in text
    assert "1.0 GiB (train.memory_limit): fits" in text and f"{evals} evaluations" in text


def test_measuring_stays_within_its_budget(small_corpus: Path) -> None:
    config = config_from_dict(_raw(small_corpus))
    start = time.perf_counter()
    plan = make_plan(config, "cpu", measure_s=0.3)
    assert time.perf_counter() - start < 5.0  # the budget, plus building and counting
    assert plan.timing is not None and plan.timing.seconds < 1.5


def test_ddp_world_size_from_the_environment(
    small_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = config_from_dict(_raw(small_corpus))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    plan = make_plan(config, "cpu", measure_s=0.1)
    one = estimate_memory(config, plan.vocab_size)
    assert plan.to_json()["tokens_per_step"] == 4 * 16 * 4
    assert plan.memory.grads == 2 * one.grads  # DDP's buckets copy the gradients
    assert "x 4 processes" in format_plan(plan)


def test_a_run_that_does_not_fit_is_not_measured(small_corpus: Path) -> None:
    plan = make_plan(config_from_dict(_raw(small_corpus, memory_limit=1000)), "cpu")
    got = plan.to_json()
    assert got["fits"] is False and got["step_s"] is None and got["eta_s"] is None
    assert "does NOT fit" in format_plan(plan)


def test_plan_resolves_an_automatic_batch_as_train_does(small_corpus: Path) -> None:
    raw = _raw(small_corpus, memory_limit="1GiB")
    raw["train"].update(batch_size="auto", tokens_per_step=16 * 16)
    got = make_plan(config_from_dict(raw), "cpu", measure_s=0.1)
    assert got.config.train.batch_size == 16 and got.config.train.grad_accum == 1
    assert got.to_json()["tokens_per_step"] == 256


@pytest.mark.parametrize(
    ("data", "vocab", "said"),
    [
        ({"tokenizer": "char"}, ASSUMED_VOCAB, f"Vocabulary assumed: {ASSUMED_VOCAB} tokens."),
        ({"tokenizer": "bpe", "vocab_size": 300}, 300, "Vocabulary: data.vocab_size."),
    ],
)
def test_missing_data_still_plans_and_says_what_is_missing(
    tmp_path: Path, data: dict, vocab: int, said: str
) -> None:
    raw = _raw(tmp_path)
    raw["data"] = {"path": str(tmp_path / "nowhere.txt"), "cache_dir": str(tmp_path), **data}
    plan = make_plan(config_from_dict(raw), "cpu", measure_s=0.1)
    assert plan.vocab_size == vocab
    assert plan.missing is not None and "nowhere.txt" in plan.missing and said in plan.missing
    assert plan.to_json()["params"] == Transformer(plan.config.model, vocab).num_parameters()
    assert plan.timing is not None  # random tokens need no data
    assert format_plan(plan).splitlines()[-1].split(maxsplit=1) == ["missing", plan.missing]


def test_cli_prints_json_and_text_and_refuses_a_limit_below_the_weights(
    small_corpus: Path, tmp_path: Path, capsys
) -> None:
    config_file = tmp_path / "c.yaml"
    config_file.write_text(yaml.safe_dump(_raw(small_corpus)))
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(config_file), "--device", "cpu", "--json"])
    assert exit_.value.code == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got) == JSON_FIELDS and set(got["memory"]) == {
        "weights",
        "grads",
        "optimizer",
        "activations",
        "peak",
    }
    assert got["fits"] is True and got["step_s"] > 0 and math.isfinite(got["eta_s"])

    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(config_file), "--set", "train.batch_size=auto"])
    assert exit_.value.code == 2
    assert "train.batch_size ('auto') needs train.tokens_per_step" in capsys.readouterr().err

    auto = ["--set", "train.batch_size=auto", "--set", "train.tokens_per_step=64"]
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(config_file), *auto, "--set", "train.memory_limit=10KB"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "smallest limit that works is" in err and "Traceback" not in err
