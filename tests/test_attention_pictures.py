"""Tests for llmcli.inspection.pictures: one PNG per layer, readable token labels."""

from __future__ import annotations

from attention_helpers import make_dump

from llmcli.inspection.pictures import label_step, plot_layers, token_label


def test_plot_layers_writes_one_png_per_layer(tmp_path) -> None:
    dump = make_dump()
    paths = plot_layers(dump, tmp_path)
    assert [p.name for p in paths] == ["layer-0.png", "layer-2.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_label_thinning() -> None:
    assert label_step(20) == 1
    assert label_step(64) == 2
    assert label_step(256) == 8
    assert token_label(" \n") == "␣↵"
