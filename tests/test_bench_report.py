"""`llmcli bench`'s report (llmcli/bench/report.py): the table, JSON and PNG, and the command
that writes them, on a tiny config."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest
from test_bench_measure import SMALL

from llmcli.bench.measure import BenchResult
from llmcli.bench.report import format_table, write_report
from llmcli.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_table_json_and_png(tmp_path: Path) -> None:
    results = [
        BenchResult(
            2,
            64,
            head_size=8,
            n_params=100,
            train_tokens_per_s=1234.5,
            sample_tokens_per_s=50.25,
            forward_ms=1.5,
            peak_memory_mb=300.0,
            memory_growth_mb=20.0,
            memory_kind="cpu_peak_rss",
        ),
        BenchResult(
            2,
            128,
            head_size=8,
            n_params=164,
            train_tokens_per_s=1000.0,
            sample_tokens_per_s=40.0,
            forward_ms=2.5,
            peak_memory_mb=310.0,
            memory_growth_mb=30.0,
            memory_kind="cpu_peak_rss",
        ),
        BenchResult(3, 64, status="invalid", message="n_embed (16) not divisible by 3"),
        BenchResult(3, 128, status="invalid", message="n_embed (16) not divisible by 3"),
    ]
    table = format_table(results).splitlines()
    assert table[0].split()[:2] == ["heads", "seq"]
    assert table[1].split() == ["2", "64", "8", "1,234", "50.2", "1.50", "300", "20"]
    assert table[3].split()[:4] == ["3", "64", "-", "invalid"]
    assert table[-1] == "heads=3 (seq 64, 128) invalid: n_embed (16) not divisible by 3"

    json_path, png_path = write_report(results, tmp_path / "out", {"benchmark": "test"})
    report = json.loads(json_path.read_text())
    assert report["benchmark"] == "test"
    assert [(r["n_head"], r["context_length"], r["status"]) for r in report["results"]] == [
        (2, 64, "ok"),
        (2, 128, "ok"),
        (3, 64, "invalid"),
        (3, 128, "invalid"),
    ]
    assert report["results"][1]["train_tokens_per_s"] == 1000.0
    image = matplotlib.image.imread(png_path)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert not list((tmp_path / "out").glob(".*"))  # no temp files left behind


def test_cli_bench_writes_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "small.yaml"
    config.write_text(json.dumps(SMALL))
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "bench",
                str(config),
                "--heads",
                "2,3",
                "--seq",
                "8",
                "--steps",
                "1",
                "--sample-tokens",
                "3",
                "--no-isolate",
                "--no-progress",
                "--out",
                str(tmp_path / "out"),
            ]
        )
    out = capsys.readouterr()
    assert exit_.value.code == 0, out.err
    assert "invalid" in out.out and "wrote" in out.out
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [r["status"] for r in report["results"]] == ["ok", "invalid"]
    assert report["config"]["model"]["n_embed"] == 16
    assert (tmp_path / "out" / "bench.png").stat().st_size > 0
