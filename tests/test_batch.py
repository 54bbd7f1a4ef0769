"""The micro-batch and accumulation (llmcli/training/batch.py): `train.batch_size: auto` under
`train.memory_limit`, `train.tokens_per_step`, the run's record and resume, and a smaller
micro-batch after an early out-of-memory error."""

from __future__ import annotations

import logging
import math
import signal
from pathlib import Path

import pytest
import torch
import yaml
from conftest import small_run_config

from llmcli.cli import main
from llmcli.config import config_from_dict, dump_yaml
from llmcli.data.tokens import prepare_data
from llmcli.errors import ConfigError, InputError
from llmcli.model.gpt import Transformer
from llmcli.runs.formats import read_weights
from llmcli.training.batch import (
    AUTO_HEADROOM,
    OOM_RETRY_STEPS,
    choose_micro_batch,
    may_shrink,
    resolve_batch,
    smaller_micro_batch,
)
from llmcli.training.loop import train
from llmcli.training.memory import RUNTIME_BYTES, estimate_memory

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
SHAPE = {"n_layer": 2, "n_head": 4, "n_embed": 64, "context_length": 32}
V = 50


def _config(**train: object):
    return config_from_dict({"model": SHAPE, "train": train}, name="t")


# --- the config's rules ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("train", "match"),
    [
        ({"batch_size": "auto"}, r"train.batch_size \('auto'\) needs train.tokens_per_step"),
        ({"tokens_per_step": 100}, r"train.tokens_per_step \(100\) must be a multiple of "),
        ({"tokens_per_step": 0}, r"train.tokens_per_step \(0\) must be positive"),
        ({"batch_size": 0}, r"train.batch_size \(0\) must be positive"),
        ({"batch_size": "many"}, r"train.batch_size must be an integer or 'auto'"),
        ({"memory_limit": "lots"}, r"train.memory_limit \('lots'\) must be a positive number"),
        ({"memory_limit": 0}, r"train.memory_limit \(0\) must be a positive number"),
    ],
)
def test_bad_batch_settings_name_the_key(train: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _config(**train)


def test_tokens_per_step_not_a_multiple_of_the_context_suggests_two_that_are() -> None:
    with pytest.raises(ConfigError, match=r"\(32\): a step is whole sequences; for .* 96 or 128"):
        _config(batch_size="auto", tokens_per_step=100)


@pytest.mark.parametrize(
    ("limit", "expected"),
    [
        ("4GB", 4 * 2**30),
        ("4G", 4 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5 gb", int(1.5 * 2**30)),
        ("2048", 2048),
        (3_000_000, 3_000_000),
        (None, None),
    ],
)
def test_memory_limit_takes_bytes_or_sizes(limit: object, expected: int | None) -> None:
    assert _config(memory_limit=limit).train.memory_limit_bytes == expected


# --- choosing the micro-batch ----------------------------------------------------------------


def _by_hand(config) -> tuple[int, int]:
    """(fixed bytes, activation bytes per sequence) of a fp32 AdamW step on the CPU, from the
    built model and the documented formula (no dropout: CPU SDPA keeps no attention weights)."""
    n = sum(p.numel() for p in Transformer(config.model, V).parameters())
    L, C, T = SHAPE["n_layer"], SHAPE["n_embed"], SHAPE["context_length"]
    fixed = 4 * n + 4 * n + 8 * n + RUNTIME_BYTES["cpu"]  # weights, grads, AdamW, runtime
    per_sequence = T * 4 * (L * 20 * C + 4 * C + 4 * V)
    return fixed, per_sequence


def test_auto_takes_the_largest_micro_batch_that_fits_and_divides_the_step() -> None:
    tokens = 12 * 32  # 12 sequences per step
    fixed, per_seq = _by_hand(_config())
    limit = math.ceil((fixed + 5.5 * per_seq) / AUTO_HEADROOM)  # room for 5 sequences
    config = _config(batch_size="auto", tokens_per_step=tokens, memory_limit=limit)
    resolved = resolve_batch(config, V, CPU, "float32")
    # 5 fit, but 12 sequences split into micro-batches of 4 (5 does not divide 12).
    assert (resolved.train.batch_size, resolved.train.grad_accum) == (4, 3)
    assert resolved.train.tokens_per_step == tokens and config.train.batch_size == "auto"
    roomy = _config(batch_size="auto", tokens_per_step=tokens, memory_limit=fixed * 100)
    assert resolve_batch(roomy, V, CPU, "float32").train.batch_size == 12


def test_a_limit_too_small_for_one_sequence_names_the_smallest_that_works() -> None:
    fixed, per_seq = _by_hand(_config())
    smallest = math.ceil((fixed + per_seq) / AUTO_HEADROOM)
    assert choose_micro_batch(_limited(smallest), V, CPU, "float32") == 1
    with pytest.raises(InputError, match=rf"smallest limit that works is {smallest} bytes"):
        choose_micro_batch(_limited(smallest - 1), V, CPU, "float32")
    weights_only = 4 * sum(p.numel() for p in Transformer(_config().model, V).parameters())
    with pytest.raises(InputError, match=r"train.memory_limit \(\d+\) is [\d.]+ KiB, too little"):
        choose_micro_batch(_limited(weights_only // 2), V, CPU, "float32")


def _limited(limit: int):
    return _config(batch_size="auto", tokens_per_step=4 * 32, memory_limit=limit)


def test_a_given_batch_with_tokens_per_step_sets_the_accumulation() -> None:
    config = _config(batch_size=2, tokens_per_step=8 * 32)
    assert resolve_batch(config, V, CPU, "float32").train.grad_accum == 4
    # Two processes: each trains on half the sequences.
    assert resolve_batch(config, V, CPU, "float32", world_size=2).train.grad_accum == 2
    with pytest.raises(InputError, match=r"train.batch_size \(3\) does not divide"):
        resolve_batch(_config(batch_size=3, tokens_per_step=8 * 32), V, CPU, "float32")
    with pytest.raises(InputError, match=r"train.grad_accum \(2\) disagrees"):
        config = _config(batch_size=2, grad_accum=2, tokens_per_step=8 * 32)
        resolve_batch(config, V, CPU, "float32")
    with pytest.raises(InputError, match=r"x the 3 processes \(96\)"):
        resolve_batch(config, V, CPU, "float32", world_size=3)


def test_smaller_micro_batch_halves_or_takes_the_next_divisor_down() -> None:
    def smaller(batch: int, accum: int) -> int | None:
        return smaller_micro_batch(_config(batch_size=batch, grad_accum=accum))

    assert smaller(8, 1) == 4
    assert smaller(6, 2) == 3
    assert smaller(3, 4) == 1  # 12 sequences: 1 is the only divisor <= 1.5
    assert smaller(1, 8) is None


def test_running_out_of_memory_shrinks_the_micro_batch_in_the_first_steps_only() -> None:
    config = _config(batch_size=8, grad_accum=1)
    last = OOM_RETRY_STEPS - 1  # the last 0-based step that may still shrink
    assert may_shrink(config, 0) and may_shrink(config, last)
    assert not may_shrink(config, last + 1)
    assert not may_shrink(_config(batch_size=1, grad_accum=8), 0)  # already one sequence


# --- training with an automatic micro-batch --------------------------------------------------


def _limit_for(corpus: Path, batch: int) -> int:
    """A memory_limit under which `auto` picks `batch` (of 8) for `small_run_config(corpus)`."""
    config = config_from_dict(small_run_config(corpus))
    vocab = prepare_data(config.data, config.model.context_length).tokenizer.vocab_size
    return math.ceil(estimate_memory(config, vocab, batch_size=batch).peak / AUTO_HEADROOM)


def _auto_raw(corpus: Path, limit: int | None = None, **train: object) -> dict:
    raw = small_run_config(corpus, max_steps=6, **train)
    raw["train"].update(batch_size="auto", tokens_per_step=8 * 16)
    if limit is not None:
        raw["train"]["memory_limit"] = limit
    return raw


def _recorded(run_dir: Path) -> tuple[int, int]:
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
    return saved["batch_size"], saved["grad_accum"]


def test_auto_batch_is_recorded_and_resume_reuses_it_exactly(
    small_corpus: Path, tmp_path: Path, ctrl_c_raises
) -> None:
    four = _limit_for(small_corpus, 4)
    reference = train(
        config_from_dict(_auto_raw(small_corpus, four)), out_dir=tmp_path / "a", progress=False
    )
    assert _recorded(tmp_path / "a") == (4, 2) and reference.tokens == 6 * 128

    def interrupt(step: int) -> None:
        if step == 3:
            signal.raise_signal(signal.SIGINT)

    run_dir = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        train(
            config_from_dict(_auto_raw(small_corpus, four)),
            out_dir=run_dir,
            progress=False,
            on_step=interrupt,
        )
    # Resumed where a micro-batch of all 8 sequences fits: the run keeps its 4 x 2.
    raw = _auto_raw(small_corpus, _limit_for(small_corpus, 8))
    summary = train(config_from_dict(raw), out_dir=run_dir, resume=True, progress=False)
    assert summary.resumed_from == 3 and _recorded(run_dir) == (4, 2)
    a, _ = read_weights(tmp_path / "a" / "model.safetensors")
    b, _ = read_weights(run_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _oom_above(monkeypatch: pytest.MonkeyPatch, batch: int) -> list[int]:
    """Make the model's forward raise torch.OutOfMemoryError for micro-batches above `batch`,
    as CUDA does; returns the micro-batch of every call."""
    forward = Transformer.forward
    calls: list[int] = []

    def limited(self: Transformer, idx: torch.Tensor, *args: object, **kwargs: object):
        calls.append(idx.shape[0])
        if self.training and idx.shape[0] > batch:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(self, idx, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", limited)
    return calls


def test_out_of_memory_in_the_first_steps_halves_an_automatic_micro_batch(
    small_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    calls = _oom_above(monkeypatch, batch=2)
    training_calls: list[int] = []
    counting = Transformer.forward  # the limited forward, counted in training mode

    def counted(self: Transformer, idx: torch.Tensor, *args: object, **kwargs: object):
        if self.training:
            training_calls.append(idx.shape[0])
        return counting(self, idx, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", counted)
    with caplog.at_level(logging.WARNING, logger="llmcli.training.batch"):
        summary = train(
            config_from_dict(_auto_raw(small_corpus, 10**10)),
            out_dir=tmp_path / "r",
            progress=False,
        )
    notes = [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]
    assert notes == [
        "note: out of memory at step 1 with 8 sequences per micro-batch: going on with 4 x "
        "grad_accum 2 (the same 128 tokens per step)",
        "note: out of memory at step 1 with 4 sequences per micro-batch: going on with 2 x "
        "grad_accum 4 (the same 128 tokens per step)",
    ]
    assert calls[:3] == [8, 4, 2] and set(calls[3 : 3 + 6 * 4]) == {2}
    # every step after the shrink is 4 micro-batches of 2: the step accumulates what the config says
    assert training_calls == [8, 4] + [2] * (6 * 4)
    assert _recorded(tmp_path / "r") == (2, 4)
    assert summary.step == 6 and summary.tokens == 6 * 128
    assert math.isfinite(summary.val_loss)


def test_out_of_memory_with_a_given_batch_is_bad_input(
    small_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    _oom_above(monkeypatch, batch=2)
    config_file = tmp_path / "c.yaml"
    config_file.write_text(dump_yaml(config_from_dict(small_run_config(small_corpus))))
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(config_file), "--out", str(tmp_path / "r"), "--no-progress"])
    assert exit_.value.code == 2
    assert "out of memory on cpu" in capsys.readouterr().err


def test_train_refuses_a_limit_smaller_than_the_model_with_exit_2(
    small_corpus: Path, tmp_path: Path, capsys
) -> None:
    config_file = tmp_path / "c.yaml"
    config_file.write_text(yaml.safe_dump(_auto_raw(small_corpus, limit=1000)))
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(config_file), "--out", str(tmp_path / "r"), "--no-progress"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "train.memory_limit (1000) is 1,000 B, too little" in err
    assert "smallest limit that works is" in err and "Traceback" not in err


def test_bench_asks_for_a_given_micro_batch(tmp_path: Path) -> None:
    from llmcli.bench.measure import BenchSettings
    from llmcli.bench.report import bench_and_report

    config = _config(batch_size="auto", tokens_per_step=4 * 32)
    with pytest.raises(InputError, match=r"--set train.batch_size=N \(`llmcli plan` says"):
        bench_and_report(config, [2], [32], "cpu", tmp_path, BenchSettings(), isolate=False)
