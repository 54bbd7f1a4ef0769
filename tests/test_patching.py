"""Activation patching (llmcli/inspection/patching.py) against one full forward per patched
activation, written out by hand, and against what patching must give at its ends."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from interpret_helpers import ARCHS, char_model, ids_of

from llmcli.errors import InputError
from llmcli.inspection.answers import AnswerMetric, record
from llmcli.inspection.patching import (
    GRIDS,
    PatchResult,
    Sites,
    format_patch,
    grid_sites,
    patch_grids,
    patched_metrics,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CLEAN, CORRUPT = "All:\nSpeak, sir.", "All:\nSpeak, her."


def setup(seed: int = 0, wrong: str | None = "s", **arch):
    tok, model = char_model(seed, **arch)
    metric = AnswerMetric.from_texts(tok, "e", wrong)
    return tok, model, metric, ids_of(tok, CLEAN), ids_of(tok, CORRUPT)


def hand_metric(model, idx, tok_a: int, tok_w: int | None, hooks=None) -> float:
    """The metric from a plain forward's last-position logits, written out."""
    with torch.no_grad(), model.hooks(hooks or {}):
        logits = model(idx)[0][0, -1].double()  # (V,)
    if tok_w is None:
        return float(torch.log_softmax(logits, -1)[tok_a])
    return float(logits[tok_a] - logits[tok_w])


def one_at_a_time(model, clean, corrupt, metric) -> dict[str, np.ndarray]:
    """Every grid, one full forward per patched activation, each hook written out."""
    names = [f"blocks.{i}.{p}" for i in range(model.n_layer) for p in GRIDS.values()]
    acts, _ = record(model, clean, names)
    a, w = metric.answer, metric.wrong
    c, d = hand_metric(model, clean, a, w), hand_metric(model, corrupt, a, w)
    T, H, grids = clean.shape[1], model.n_head, {}
    for grid, point in GRIDS.items():
        cols = H if grid == "head_out" else T
        out = np.zeros((model.n_layer, cols))
        for layer in range(model.n_layer):
            name = f"blocks.{layer}.{point}"
            for j in range(cols):

                def put(act, name=name, j=j, heads=grid == "head_out"):
                    act = act.clone()
                    if heads:
                        act[:, :, j] = acts[name][:, :, j]  # (B, T, H, hs): head j everywhere
                    else:
                        act[:, j] = acts[name][:, j]  # (B, T, C): position j
                    return act

                patched = hand_metric(model, corrupt, a, w, {name: put})
                out[layer, j] = (patched - d) / (c - d)
        grids[grid] = out
    return grids


@pytest.mark.parametrize("arch", ["default", "all"])
@pytest.mark.parametrize("wrong", ["s", None])
def test_batched_patching_equals_one_forward_per_activation(arch, wrong) -> None:
    tok, model, metric, clean, corrupt = setup(1, wrong, **ARCHS[arch])
    grids, c, d = patch_grids(model, clean, corrupt, metric)
    assert c == pytest.approx(hand_metric(model, clean, metric.answer, metric.wrong), abs=1e-5)
    assert d == pytest.approx(hand_metric(model, corrupt, metric.answer, metric.wrong), abs=1e-5)
    expected = one_at_a_time(model, clean, corrupt, metric)
    T = clean.shape[1]
    assert {k: v.shape for k, v in grids.items()} == {
        "resid_pre": (2, T),
        "attn_out": (2, T),
        "mlp_out": (2, T),
        "head_out": (2, 4),
    }
    for grid in GRIDS:
        np.testing.assert_allclose(grids[grid], expected[grid], atol=1e-4, err_msg=grid)
    # Positions before the first difference hold the same activations in both prompts.
    first = next(t for t in range(T) if clean[0, t] != corrupt[0, t])
    assert np.abs(grids["resid_pre"][:, :first]).max() < 1e-5
    assert np.abs(grids["resid_pre"][0, first:]).max() > 0.01


def test_chunks_of_any_size_give_the_same_metrics() -> None:
    tok, model, metric, clean, corrupt = setup(2)
    names = [f"blocks.{i}.{p}" for i in range(2) for p in GRIDS.values()]
    acts, _ = record(model, clean, names)
    streams, _ = record(model, corrupt, ["blocks.0.resid_pre", "blocks.1.resid_pre"])
    for grid in GRIDS:
        for layer in range(2):
            sites = grid_sites(grid, layer, model, clean.shape[1])
            stream = streams[f"blocks.{layer}.resid_pre"]
            whole = patched_metrics(model, stream, acts, sites, metric)
            for rows in (1, 3):
                chunked = patched_metrics(model, stream, acts, sites, metric, rows=rows)
                torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def test_patching_the_last_stream_gives_one_and_nothing_gives_zero() -> None:
    tok, model, metric, clean, corrupt = setup(3)
    T = clean.shape[1]
    last = f"blocks.{model.n_layer - 1}.resid_post"
    acts, _ = record(model, clean, [last])
    streams, _ = record(model, corrupt, ["blocks.0.resid_pre"])
    c = hand_metric(model, clean, metric.answer, metric.wrong)
    d = hand_metric(model, corrupt, metric.answer, metric.wrong)
    everything = torch.zeros(1, T, 1, dtype=torch.bool)
    everything[0, -1] = True  # every channel of the last position's final stream
    nothing = torch.zeros(1, T, 1, dtype=torch.bool)
    for mask, effect in ((everything, 1.0), (nothing, 0.0)):
        sites = Sites({last: mask}, start=0)
        value = patched_metrics(model, streams["blocks.0.resid_pre"], acts, sites, metric).item()
        assert (value - d) / (c - d) == pytest.approx(effect, abs=1e-4)  # float32


def test_a_head_that_writes_nothing_has_no_effect() -> None:
    tok, model, metric, clean, corrupt = setup(4)
    hs = model.n_embed // model.n_head
    with torch.no_grad():
        model.blocks[0].attn.proj.weight[:, 2 * hs : 3 * hs] = 0.0  # head 0.2's output is unused
    grids, _, _ = patch_grids(model, clean, corrupt, metric)
    assert abs(grids["head_out"][0, 2]) < 1e-4  # float32 rounding of a sum of 0s and the rest
    assert np.abs(grids["head_out"]).max() > 0.01  # the other heads do matter


def test_prompts_that_give_the_same_metric_are_refused() -> None:
    tok, model, metric, clean, _ = setup(5)
    with pytest.raises(InputError, match="give the same .*nothing to restore"):
        patch_grids(model, clean, clean, metric)


def test_json_and_text() -> None:
    tok, model, metric, clean, corrupt = setup(6)
    grids, c, d = patch_grids(model, clean, corrupt, metric)
    result = PatchResult(grids, c, d, list(CLEAN), list(CORRUPT), metric, CLEAN, CORRUPT)
    data = result.to_dict()
    assert {"resid_pre", "head_out", "attn_out", "mlp_out", "clean", "corrupt"} <= set(data)
    assert data["clean"] == c and data["corrupt"] == d
    assert data["answer"] == "e" and data["wrong"] == "s" and data["metric"] == "logit_diff"
    assert data["clean_prompt"] == CLEAN and data["corrupt_prompt"] == CORRUPT
    np.testing.assert_array_equal(np.array(data["head_out"]), grids["head_out"])
    text = format_patch(result)
    assert f"clean {c:.4f}, corrupted {d:.4f}" in text
    assert text.count("\n") == 2 + 3 + 1 + model.n_layer
