"""Tests for llmcli.inspection.grids and the run pages of llmcli.inspection.viewer: reading a
run's lens, patching and attribution results into the viewer's grids, defensively."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from attention_helpers import make_dump
from grid_helpers import (
    TOKENS,
    T,
    attribution_result,
    lens_result,
    page_data,
    patch_result,
    write_results,
)

from llmcli.inspection.dump import save_dump
from llmcli.inspection.grids import run_grids
from llmcli.inspection.viewer import (
    refresh_run_pages,
    render_viewer,
    viewer_data,
    write_run_page,
    write_viewer,
)

IDS = [
    "lens",
    "patch-resid_pre",
    "patch-attn_out",
    "patch-mlp_out",
    "patch-head_out",
    "attribution",
]


def sig6(a) -> np.ndarray:
    """What the grids keep of a number: 6 significant digits."""
    return np.vectorize(lambda v: float(f"{v:.6g}"))(np.asarray(a, dtype=np.float64))


def by_id(grids: list[dict]) -> dict[str, dict]:
    return {g["id"]: g for g in grids}


def test_each_result_file_becomes_its_grids(tmp_path: Path) -> None:
    notes: list[str] = []
    grids = by_id(run_grids(write_results(tmp_path), notes.append))
    assert list(grids) == IDS and notes == []

    lens, data = grids["lens"], lens_result()
    assert lens["rows"] == ["embed", "0", "1"] and lens["cols"] == TOKENS[:-1]
    assert lens["row_names"] == ["embed", "after layer 0", "after layer 1"]
    assert lens["scale"] == "sequential" and lens["col_tokens"] is True
    assert lens["value"] == "log-prob" and lens["source"] == "lens/lens.json"
    np.testing.assert_array_equal(lens["values"], sig6(data["logprobs"]))
    assert lens["values"][-1][0] == -0.0123457
    # Cell (boundary 1, position 2) predicts token 3 "M"; the lens's top token there is "M".
    assert lens["cell_notes"][1][2] == 'next "M", top "M", row\'s mean loss 3.2500'

    patch = patch_result()
    for key in ("resid_pre", "attn_out", "mlp_out"):
        g = grids[f"patch-{key}"]
        assert (g["rows"], g["cols"]) == (["0", "1"], TOKENS)
        np.testing.assert_array_equal(g["values"], sig6(patch[key]))
        assert g["scale"] == "diverging" and g["domain"] == [-1.0, 1.0]
    head = grids["patch-head_out"]
    assert head["cols"] == ["0", "1", "2"] and head["col_title"] == "head"
    np.testing.assert_array_equal(head["values"], sig6(patch["head_out"]))
    first = grids["patch-resid_pre"]["note"]
    assert first.startswith('clean +2.5000, corrupt -1.2500; answer "a"; wrong "o"')
    assert 'corrupt prompt "RO J\\n"' in first and grids["patch-mlp_out"]["note"] == ""

    attr, data = grids["attribution"], attribution_result()
    assert attr["cols"] == ["0", "1", "2", "MLP"] and attr["rows"] == ["0", "1"]
    assert attr["col_names"] == ["head 0", "head 1", "head 2", "MLP"]
    expected = np.concatenate([data["heads"], np.array(data["mlp"])[:, None]], axis=1)
    np.testing.assert_array_equal(attr["values"], sig6(expected))
    bound = np.abs(sig6(expected)).max()
    assert attr["domain"] == [-bound, bound]
    assert (
        f"logit difference {data['logit_diff']:+.4f}; embed +0.2500; rest -0.0625" in (attr["note"])
    )


def test_patch_effects_past_one_widen_the_scale(tmp_path: Path) -> None:
    patch = patch_result()
    patch["attn_out"][1][2] = -1.75
    grids = by_id(run_grids(write_results(tmp_path, patch=patch, lens=None, attribute=None)))
    assert grids["patch-attn_out"]["domain"] == [-1.75, 1.75]
    assert grids["patch-resid_pre"]["domain"] == [-1.0, 1.0]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"lens": "{not json"}, "lens.json: not readable as JSON"),
        ({"lens": [1, 2]}, "lens.json: not a JSON object"),
        ({"lens": {**lens_result(), "logprobs": [[0.1, 0.2], [0.3]]}}, "rows of different"),
        ({"lens": {**lens_result(), "logprobs": None}}, '"logprobs" is missing'),
        ({"attribute": {**attribution_result(), "mlp": [1.0]}}, '"mlp" has 1 numbers for 2'),
        ({"attribute": {**attribution_result(), "heads": [["x"]]}}, "other than numbers"),
        ({"patch": {"clean": 1.0}}, "patch.json: none of resid_pre"),
        ({"lens": b'{"layers": "\xff"}'}, "lens.json: not readable as JSON"),
    ],
)
def test_a_malformed_file_is_skipped_with_a_notice(tmp_path: Path, override, message) -> None:
    notes: list[str] = []
    grids = run_grids(write_results(tmp_path, **override), notes.append)
    kind = next(iter(override))
    skipped = {"lens": ["lens"], "attribute": ["attribution"]}.get(kind, IDS[1:5])
    assert [g["id"] for g in grids] == [i for i in IDS if i not in skipped]
    assert len(notes) == 1 and notes[0].startswith("viewer: skipping ")
    assert message in notes[0], notes


def test_what_is_missing_is_left_out_and_the_rest_shown(tmp_path: Path) -> None:
    patch = patch_result()
    del patch["head_out"], patch["tokens"], patch["answer"]
    patch["attn_out"] = [[0.5] * T, [0.5] * (T - 1)]  # one grid malformed: only it goes
    lens = lens_result()
    del lens["top_tokens"], lens["loss"], lens["prompt"]
    lens["tokens"] = TOKENS[:3]  # labels that do not fit are not used
    attr = attribution_result()
    del attr["mlp"], attr["embed"]
    notes: list[str] = []
    run_dir = write_results(tmp_path, patch=patch, lens=lens, attribute=attr)
    grids = by_id(run_grids(run_dir, notes.append))
    assert list(grids) == ["lens", "patch-resid_pre", "patch-mlp_out", "attribution"]
    assert notes == [
        'viewer: skipping attn_out of patch/patch.json: "attn_out" has rows of different '
        "lengths (or empty ones)"
    ]
    assert grids["patch-resid_pre"]["cols"] == ["0", "1", "2", "3", "4"]
    assert grids["patch-resid_pre"]["col_tokens"] is False
    assert "answer" not in grids["patch-resid_pre"]["note"]
    assert grids["lens"]["cols"] == ["0", "1", "2", "3"] and grids["lens"]["cell_notes"] is None
    assert grids["lens"]["note"] == ""
    assert (
        grids["attribution"]["cols"] == ["0", "1", "2"]
        and "embed" not in (grids["attribution"]["note"])
    )
    assert run_grids(tmp_path / "nothing") == [] and run_grids(None) == []


def test_non_finite_values_become_null_and_the_page_still_renders(tmp_path: Path) -> None:
    lens = lens_result()
    lens["logprobs"][0][1] = math.inf
    lens["logprobs"][1][2] = math.nan
    lens["top_tokens"] = [row + ["Z"] for row in lens["top_tokens"]]  # T entries a row: fine
    grids = run_grids(write_results(tmp_path, lens=lens, patch=None, attribute=None))
    assert grids[0]["values"][0][1] is None and grids[0]["values"][1][2] is None
    assert grids[0]["cell_notes"][2][3].startswith('next "\\n", top "D"')
    assert page_data(render_viewer(None, grids))[1] == json.loads(json.dumps(grids))


# ------------------------------------------------------------------ pages of a run


def test_write_run_page_without_a_dump_shows_the_grids_alone(tmp_path: Path) -> None:
    run_dir = write_results(tmp_path / "run")
    page = write_run_page(run_dir)
    assert page == run_dir / "attention" / "attention.html"
    attention, grids = page_data(page.read_text(encoding="utf-8"))
    assert attention is None and [g["id"] for g in grids] == IDS


def test_refresh_rewrites_each_page_with_its_own_dump_and_the_new_grids(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    dumps = {}
    for folder, T_ in (("prompt-000", 4), ("prompt-001", 6)):
        dumps[folder] = make_dump(T=T_)
        out = run_dir / "attention" / folder
        save_dump(dumps[folder], out / "attention.json", "json")
        write_viewer(dumps[folder], out / "attention.html")
    assert page_data((out / "attention.html").read_text())[1] == []
    write_results(run_dir, patch=None)
    pages = refresh_run_pages(run_dir)
    assert pages == [run_dir / "attention" / f / "attention.html" for f in dumps]
    for folder, page in zip(dumps, pages, strict=True):
        attention, grids = page_data(page.read_text(encoding="utf-8"))
        assert attention["tokens"] == viewer_data(dumps[folder])["tokens"]
        assert attention["attn_b64"] == viewer_data(dumps[folder])["attn_b64"]
        assert [g["id"] for g in grids] == ["lens", "attribution"]
    assert not (run_dir / "attention" / "attention.html").exists()


def test_a_damaged_dump_leaves_the_page_without_attention(tmp_path: Path) -> None:
    run_dir = write_results(tmp_path / "run")
    (run_dir / "attention").mkdir()
    (run_dir / "attention" / "attention.npz").write_bytes(b"not a zip")
    notes: list[str] = []
    page = write_run_page(run_dir, notify=notes.append)
    assert page_data(page.read_text())[0] is None
    assert len(notes) == 1 and "cannot read the attention dump" in notes[0]


def test_inspect_attention_outputs_include_the_runs_grids(tmp_path: Path) -> None:
    from llmcli.inspection.attention import write_outputs

    run_dir = write_results(tmp_path / "run", lens="[]")
    notes: list[str] = []
    dump = make_dump()
    write_outputs(dump, tmp_path / "out", pictures=False, run_dir=run_dir, notify=notes.append)
    attention, grids = page_data((tmp_path / "out" / "attention.html").read_text())
    assert attention == viewer_data(dump)
    assert [g["id"] for g in grids] == IDS[1:]
    assert notes == [f"viewer: skipping {run_dir / 'lens/lens.json'}: not a JSON object"]
