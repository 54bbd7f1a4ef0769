"""`llmcli bench`'s measurements (llmcli/bench/measure.py): combinations, speeds and errors on a
tiny config.

Speeds are never compared with a threshold: measured ones are checked positive and finite, and
their arithmetic exact under a fake clock.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import llmcli.bench.measure
import llmcli.device
from llmcli.bench.measure import (
    BenchSettings,
    parse_int_list,
    run_bench,
    vocab_size_for,
)
from llmcli.cli import main
from llmcli.config import config_from_dict
from llmcli.errors import InputError
from llmcli.generation.engine import generate
from llmcli.model.gpt import Transformer
from llmcli.training.step import train_step

SMALL = {
    "model": {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 16},
    "train": {"batch_size": 2, "device": "cpu"},
}
QUICK = BenchSettings(train_steps=1, sample_tokens=4, forward_reps=1, vocab_size=11)


pytestmark = pytest.mark.usefixtures("one_thread")


def small_config():
    return config_from_dict(SMALL, name="small")


def positive(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def test_parse_int_list() -> None:
    assert parse_int_list("1,2, 4,8", "heads") == [1, 2, 4, 8]
    assert parse_int_list("4,4,2", "heads") == [4, 2]
    with pytest.raises(InputError, match=r"--seq .*'x' in '64,x' is not an integer"):
        parse_int_list("64,x", "seq")
    with pytest.raises(InputError, match="must be positive, got 0"):
        parse_int_list("0,1", "heads")
    with pytest.raises(InputError, match="is not an integer"):
        parse_int_list("", "heads")


def test_every_combination_is_measured_or_explained() -> None:
    results = run_bench(
        small_config(), [1, 3, 2], [8, 16], "cpu", QUICK, isolate=False, progress=False
    )
    assert [(r.n_head, r.context_length) for r in results] == [
        (1, 8),
        (1, 16),
        (3, 8),
        (3, 16),
        (2, 8),
        (2, 16),
    ]
    for r in results:
        if r.n_head == 3:
            assert r.status == "invalid"
            assert "n_embed (16) must be divisible by model.n_head (3)" in r.message
            assert r.train_tokens_per_s is None
            continue
        assert r.status == "ok", r.message
        assert r.head_size == 16 // r.n_head
        assert positive(r.train_tokens_per_s) and positive(r.sample_tokens_per_s)
        assert positive(r.forward_ms)
        # In-process CPU runs cannot tell one combination's peak RSS from another's.
        assert r.peak_memory_mb is None and r.memory_kind is None
    # The parameter count depends on neither the head count nor (without a position table
    # entry per extra position) anything else than the context length.
    by_combo = {(r.n_head, r.context_length): r.n_params for r in results if r.status == "ok"}
    assert by_combo[(1, 8)] == by_combo[(2, 8)]
    assert by_combo[(1, 16)] - by_combo[(1, 8)] == 8 * 16  # 8 more rows of the (T, C) table


class FakeClock:
    """`time.perf_counter` for `llmcli.device.timed`, which times bench's work, advanced only
    by that work."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_speeds_are_the_work_over_the_time_it_took(monkeypatch) -> None:
    """Under a clock on which a training step takes 0.5 s, a full-length forward 4 ms, and
    sampling 0.3 s to start and 0.1 s a token, the speeds are those figures' arithmetic."""
    clock = FakeClock()
    monkeypatch.setattr(llmcli.device, "time", clock)
    real_step, real_generate, real_model = train_step, generate, Transformer

    def step(*args, **kwargs):
        clock.now += 0.5
        return real_step(*args, **kwargs)

    def sample(*args, **kwargs):
        clock.now += 0.3
        for ids in real_generate(*args, **kwargs):
            clock.now += 0.1
            yield ids

    def model(*args, **kwargs):
        built = real_model(*args, **kwargs)

        def forward_ran(module, inputs, output) -> None:
            if not module.training and inputs[0].shape == (1, module.context_length):
                clock.now += 0.004  # the (1, T) latency forward; sampling feeds (1, 1)

        built.register_forward_hook(forward_ran)
        return built

    monkeypatch.setattr(llmcli.bench.measure, "train_step", step)
    monkeypatch.setattr(llmcli.bench.measure, "generate", sample)
    monkeypatch.setattr(llmcli.bench.measure, "Transformer", model)
    settings = BenchSettings(train_steps=3, sample_tokens=10, forward_reps=3, vocab_size=11)
    results = run_bench(
        small_config(), [2], [8, 16], "cpu", settings, isolate=False, progress=False
    )
    assert [r.status for r in results] == ["ok", "ok"]
    B = SMALL["train"]["batch_size"]
    for r, new_tokens in zip(results, (7, 10), strict=True):  # min(10, T - 1): the cache fits
        T = r.context_length
        assert r.train_tokens_per_s == pytest.approx(B * T / 0.5)  # 3 steps in 1.5 s
        assert r.forward_ms == pytest.approx(4.0)
        assert r.sample_tokens_per_s == pytest.approx(new_tokens / (0.3 + 0.1 * new_tokens))


@pytest.mark.slow
def test_isolated_run_reports_peak_rss() -> None:
    (result,) = run_bench(small_config(), [2], [8], "cpu", QUICK, isolate=True, progress=False)
    assert result.status == "ok", result.message
    assert result.memory_kind == "cpu_peak_rss"
    # A fresh interpreter with torch loaded holds tens of MB at least; the model adds little.
    assert result.peak_memory_mb > 50
    assert 0 <= result.memory_growth_mb < result.peak_memory_mb


def test_no_valid_combination_is_an_input_error() -> None:
    with pytest.raises(InputError, match="no combination .* is valid.*divisible"):
        run_bench(small_config(), [3, 5], [8], "cpu", QUICK, isolate=False, progress=False)


def test_bad_settings_are_input_errors() -> None:
    with pytest.raises(InputError, match="train-steps \\(0\\)"):
        run_bench(
            small_config(),
            [2],
            [8],
            "cpu",
            BenchSettings(train_steps=0),
            isolate=False,
            progress=False,
        )


def test_vocab_size_for(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("abcab\n")
    assert vocab_size_for(config_from_dict({"data": {"path": str(corpus)}})) == 4  # a b c \n
    assert (
        vocab_size_for(
            config_from_dict({"data": {"path": str(corpus), "tokenizer": "bpe", "vocab_size": 300}})
        )
        == 300
    )
    assert vocab_size_for(config_from_dict({"data": {"path": str(tmp_path)}})) == 256


@pytest.mark.parametrize(
    "args, message",
    [
        (["--heads", "2,x"], "--heads takes comma-separated positive integers"),
        (["--heads", "3"], "no combination of --heads and --seq is valid"),
        (
            ["--device", "cuda"] if not torch.cuda.is_available() else ["--seq", "0"],
            "cuda" if not torch.cuda.is_available() else "must be positive",
        ),
    ],
)
def test_cli_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    config = tmp_path / "small.yaml"
    config.write_text(json.dumps(SMALL))
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "bench",
                str(config),
                "--no-isolate",
                "--no-progress",
                "--out",
                str(tmp_path / "out"),
                *args,
            ]
        )
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert message in err and "Traceback" not in err
