"""Model FLOPs utilisation (llmcli/training/mfu.py): the peak measured once a process, each
training record's `mfu` the plan's FLOPs per token times its tokens/s over that peak, and
`llmcli info` showing it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import small_run_config

from llmcli.config import config_from_dict
from llmcli.runs.formats import read_meta
from llmcli.runs.info import format_info, run_info
from llmcli.runs.loading import load_run
from llmcli.runs.metrics import read_metrics
from llmcli.training.loop import train
from llmcli.training.mfu import mfu, peak_flops

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_peak_is_a_matrix_products_rate_measured_once() -> None:
    cpu = torch.device("cpu")
    first = peak_flops(cpu, torch.float32)
    assert 1e8 < first < 1e14  # FLOP/s of a CPU core or more
    assert peak_flops(cpu, torch.float32) == first  # measured once a process
    assert mfu(1000, 50.0, 1e6) == pytest.approx(0.05)
    assert mfu(1000, 50.0, 1e6, world_size=2) == pytest.approx(0.025)  # per process


def test_each_training_record_carries_its_mfu_and_info_shows_the_last(
    small_corpus: Path, tmp_path: Path
) -> None:
    config = config_from_dict(small_run_config(small_corpus, max_steps=6, log_interval=2))
    train(config, out_dir=tmp_path / "run", progress=False)
    meta = read_meta(tmp_path / "run" / "meta.json")
    # 6 N + 12 L T C written out: N the parameters without the position embeddings (the token
    # embedding is the tied LM head's weight)
    model = load_run(tmp_path / "run").model
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    m = config.model
    assert meta["flops_per_token"] == 6 * n + 12 * m.n_layer * m.context_length * m.n_embed
    assert meta["peak_flops"] == peak_flops(torch.device("cpu"), torch.float32)
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(records) == 3
    for record in records:
        expected = meta["flops_per_token"] * record["tok_per_s"] / meta["peak_flops"]
        assert record["mfu"] == pytest.approx(expected, rel=1e-3, abs=1e-5)
    info = run_info(tmp_path / "run")
    assert info["training"]["mfu"] == records[-1]["mfu"]
    row = rf"^mfu +{100 * records[-1]['mfu']:.1f}% at the last log step, of [\d,]+ GFLOP/s$"
    assert re.search(row, format_info(info), re.MULTILINE)
