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


def test_plot_grids_draws_labelled_panels_of_any_width(tmp_path) -> None:
    import numpy as np
    from matplotlib.image import imread

    from llmcli.inspection.pictures import Grid, plot_grids

    rng = np.random.default_rng(0)
    wide = Grid(rng.normal(size=(3, 20)), ["a", "b", "c"], list("Speak, speak.\nAll: "), "wide")
    narrow = Grid(rng.normal(size=(3, 4)), ["a", "b", "c"], ["0", "1", "2", "3"], "narrow")
    one = plot_grids([wide], tmp_path / "one.png", centre=None)
    two = plot_grids([wide, narrow], tmp_path / "two.png", title="t", colour_label="x")
    h1, w1 = imread(one).shape[:2]
    h2, w2 = imread(two).shape[:2]
    assert h2 > 1.5 * h1  # a second panel below, cells of the same size
    assert abs(w2 - w1) < 0.2 * w1
