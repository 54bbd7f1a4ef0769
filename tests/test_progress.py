"""Progress display (llmcli/progress.py): a bar on a terminal, plain lines in a log or a pipe."""

from __future__ import annotations

import io
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmcli import progress
from llmcli.progress import Progress, counted, first_few

ROOT = Path(__file__).resolve().parents[1]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_report_and_tenths_are_plain_lines(monkeypatch, caplog) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with caplog.at_level(logging.INFO, logger="llmcli.progress"):
        with Progress(50, desc="tokenizing x", unit="B", tenths=True) as bar:
            for _ in range(50):
                bar.update(1)
            bar.report({"loss": "1.2345"})
    assert err.getvalue() == ""  # no bar drawn at all
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(",")[0] for line in lines[:10]] == [
        f"tokenizing x {n}/50" for n in range(5, 51, 5)
    ]
    assert lines[-1].startswith("tokenizing x 50/50, loss 1.2345, ")


@pytest.mark.parametrize("total", [25, 632, 10, 7, 3, 1])
def test_tenths_log_each_tenth_once(monkeypatch, caplog, total: int) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger="llmcli.progress"):
        with Progress(total, desc="eval", tenths=True) as bar:
            for _ in range(total):
                bar.update(1)
    counts = [int(r.getMessage().split()[1].split("/")[0]) for r in caplog.records]
    # Tenth k is reached at ceil(k * total / 10); tenths on the same count share one line.
    expected = sorted({math.ceil(k * total / 10) for k in range(1, 11)})
    assert counts == expected
    assert len(counts) == min(total, 10)


def test_tenths_after_a_resume_start_past_the_initial_count(monkeypatch, caplog) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger="llmcli.progress"):
        with Progress(25, desc="x", initial=12, tenths=True) as bar:
            bar.update(1)  # 13: the tenth at 12.5
            bar.update(12)  # 25: every tenth left, one line
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["x 13/25", "x 25/25"]


class ZeroWidthTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return 2


def test_a_terminal_of_zero_columns_gets_plain_lines(monkeypatch, caplog) -> None:
    term = ZeroWidthTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(progress.os, "get_terminal_size", lambda fd: os.terminal_size((0, 0)))
    with caplog.at_level(logging.INFO, logger="llmcli.progress"):
        with Progress(20, desc="train", unit="step") as bar:
            bar.update(10)
            bar.report({"loss": "2.0"})
    assert term.getvalue() == ""
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["train 10/20"]
    monkeypatch.setattr(progress.os, "get_terminal_size", lambda fd: os.terminal_size((80, 24)))
    assert progress.stderr_bar_fits() is True


def test_on_a_terminal_the_bar_redraws_and_nothing_is_logged(monkeypatch, caplog) -> None:
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    with caplog.at_level(logging.INFO, logger="llmcli.progress"):
        with Progress(20, desc="train", unit="step", tenths=True, mininterval=0) as bar:
            for _ in range(20):
                bar.update(1)
                bar.report({"loss": "2.0"})
    assert "\r" in term.getvalue() and "train" in term.getvalue()
    assert caplog.records == []


def test_disabled_shows_nothing(monkeypatch, caplog) -> None:
    for stream in (io.StringIO(), FakeTerminal()):
        monkeypatch.setattr(sys, "stderr", stream)
        with caplog.at_level(logging.INFO, logger="llmcli.progress"):
            with Progress(5, desc="x", enabled=False, tenths=True) as bar:
                bar.update(5)
                bar.report({"a": "b"})
        assert stream.getvalue() == "" and caplog.records == []


def test_a_closed_stderr_counts_as_no_terminal(monkeypatch) -> None:
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    assert progress.stderr_is_terminal() is False


@pytest.mark.slow
def test_piped_train_log_has_no_carriage_returns(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((ROOT / "data" / "shakespeare.txt").read_text()[:20_000])
    sets = [f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}", "train.device=cpu"]
    sets += ["model.n_layer=1", "model.n_embed=32", "train.max_steps=40", "train.log_interval=10"]
    sets += ["train.eval_steps=2", "train.batch_size=4"]  # what is logged, not how much trains
    args = [sys.executable, "-m", "llmcli", "train", "tiny", "--out", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("\r") == 0
    plain = [line for line in out.stderr.splitlines() if line.startswith("train ")]
    assert [line.split(",")[0] for line in plain] == [f"train {n}/40" for n in (10, 20, 30, 40)]
    assert all(" loss " in line and " lr " in line and " tok/s " in line for line in plain)


def test_format_fixed_drops_the_sign_of_a_value_that_rounds_to_zero() -> None:
    assert progress.format_fixed(-0.0001, ".3f") == "0.000" != format(-0.0001, ".3f")
    assert progress.format_fixed(-0.0, ">7.3f") == "  0.000"
    assert progress.format_fixed(-4e-5, "+.4f") == "+0.0000"
    assert progress.format_fixed(-0.0006, ".3f") == "-0.001" == format(-0.0006, ".3f")
    assert progress.format_fixed(0.25, "+.2f") == "+0.25"


def test_counts_are_separated_and_agree_with_their_noun() -> None:
    assert counted(1, "pair") == "1 pair"
    assert counted(0, "pair") == "0 pairs"
    assert counted(943_744, "parameter") == "943,744 parameters"
    assert counted(1, "reply", "replies") == "1 reply"
    assert counted(2, "reply", "replies") == "2 replies"


def test_first_few_names_three_and_counts_the_rest() -> None:
    assert first_few(["a", "b"]) == "a, b"
    assert first_few(["a", "b", "c"]) == "a, b, c"
    assert first_few([str(i) for i in range(1_005)]) == "0, 1, 2 and 1,002 more"
