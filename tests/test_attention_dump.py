"""Tests for llmcli.inspection.dump: the three file formats and the metrics table."""

from __future__ import annotations

import json

import numpy as np
import pytest
from attention_helpers import make_dump

from llmcli.inspection.dump import FORMATS, format_metrics_table, load_dump, save_dump
from llmcli.inspection.metrics import METRIC_NAMES


@pytest.mark.parametrize("fmt", ["npz", "safetensors", "json"])
def test_dump_round_trip(tmp_path, fmt: str) -> None:
    dump = make_dump()
    path = save_dump(dump, tmp_path / f"attention{FORMATS[fmt]}", fmt)
    back = load_dump(path)
    np.testing.assert_array_equal(back.attn, dump.attn)
    np.testing.assert_array_equal(back.metrics, dump.metrics)
    np.testing.assert_array_equal(back.token_ids, dump.token_ids)
    assert back.tokens == dump.tokens
    assert back.metric_names == dump.metric_names
    assert (back.layers, back.heads) == (dump.layers, dump.heads)
    assert back.meta == dump.meta
    assert back.attn.dtype == np.float32
    assert not list(tmp_path.glob(".*tmp"))  # no temp file left behind


def test_npz_loads_without_pickle(tmp_path) -> None:
    dump = make_dump()
    path = save_dump(dump, tmp_path / "attention.npz")
    with np.load(path, allow_pickle=False) as z:
        assert set(z.files) >= {"attn", "tokens", "token_ids", "metrics", "metric_names", "meta"}
        assert z["attn"].dtype == np.float32 and z["attn"].shape == (2, 3, 6, 6)
        assert list(z["tokens"]) == dump.tokens
        assert z["metrics"].shape == (2, 3, 4)
        assert json.loads(str(z["meta"]))["checkpoint"] == "/x"


def test_json_dump_writes_nan_as_null(tmp_path) -> None:
    dump = make_dump(T=1)
    path = save_dump(dump, tmp_path / "attention.json", "json")
    obj = json.loads(path.read_text())
    assert obj["metrics"][0][0] == [None] * 4
    assert np.isnan(load_dump(path).metrics).all()


def test_metrics_table() -> None:
    dump = make_dump()
    lines = format_metrics_table(dump).splitlines()
    assert lines[0].split() == ["layer", "head", *METRIC_NAMES]
    assert len(lines) == 1 + 2 * 3
    assert lines[-1].split()[:2] == ["2", "3"]
    assert float(lines[-1].split()[2]) == pytest.approx(float(dump.metrics[1, 2, 0]), abs=1e-3)
