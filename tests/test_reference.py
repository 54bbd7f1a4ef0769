"""Reference curves (llmcli/runs/reference.py): the shipped ones, and runs placed against them by
`llmcli info` and `llmcli compare --reference`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import save_tiny_run, small_run_config

from llmcli.cli import main
from llmcli.config import config_from_dict, load_config, shipped_configs
from llmcli.data.tokenizer import CharTokenizer
from llmcli.errors import InputError
from llmcli.fileio import atomic_write_json
from llmcli.runs import reference as ref
from llmcli.runs.info import format_info, run_info
from llmcli.training.loop import train

TINY = {"model": {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 8}}
# A hand-made reference: val loss 3.0 at 1,000 tokens, 2.0 at 3,000, 1.5 at 5,000.
POINTS = [
    {"step": 1, "tokens": 1000, "elapsed_s": 1.0, "val_loss": 3.0},
    {"step": 3, "tokens": 3000, "elapsed_s": 3.0, "val_loss": 2.0},
    {"step": 5, "tokens": 5000, "elapsed_s": 5.0, "val_loss": 1.5},
]
MEASURED = {"date": "2026-12-01", "commit": "abc1234", "device": "cpu", "dtype": "float32"}
MEASURED |= {"seed": 1337, "steps": 5, "tokens": 5000, "world_size": 1}


def evals(*points: tuple[int, float]) -> str:
    """metrics.jsonl lines: a train record, then an eval record per (tokens, val_loss)."""
    lines = [{"kind": "train", "step": 1, "tokens": 10, "train_loss": 9.0}]
    lines += [
        {"kind": "eval", "step": i, "tokens": t, "elapsed_s": float(i), "val_loss": v}
        for i, (t, v) in enumerate(points, 1)
    ]
    return "".join(json.dumps(r) + "\n" for r in lines)


def make_run(
    folder: Path, raw: dict[str, Any], points: tuple, meta: dict[str, Any] | None = None
) -> Path:
    save_tiny_run(folder, CharTokenizer.train(["hello world\n"]), raw, extra_meta=meta)
    (folder / "metrics.jsonl").write_text(evals(*points))
    return folder


@pytest.fixture()
def references(tmp_path: Path, monkeypatch) -> Path:
    """A references folder holding a hand-made curve for `tiny` (whose config is TINY's) and a
    file with no curve for `small`."""
    folder = tmp_path / "references"
    folder.mkdir()
    config = config_from_dict(TINY).to_dict()
    atomic_write_json(
        folder / "tiny.json",
        {"format": 1, "name": "tiny", "points": POINTS, "config": config, "measured": MEASURED},
    )
    atomic_write_json(
        folder / "small.json",
        {"format": 1, "name": "small", "points": [], "config": {}, "measured": {}}
        | {"note": "not measured: too slow here"},
    )
    monkeypatch.setattr(ref, "references_dir", lambda: folder)
    return folder


def test_interpolate_is_numpys_interp_inside_the_points_and_none_outside() -> None:
    rng = np.random.default_rng(0)
    xs = np.sort(rng.choice(np.arange(1, 10_000), size=12, replace=False))
    ys = rng.uniform(1.0, 4.0, size=12)
    points = [{"tokens": int(x), "val_loss": float(y)} for x, y in zip(xs, ys, strict=True)]
    for t in rng.uniform(xs[0], xs[-1], size=50):
        assert ref.interpolate(points, t) == pytest.approx(np.interp(t, xs, ys), abs=1e-12)
    assert ref.interpolate(points, int(xs[3])) == float(ys[3])
    assert (
        ref.interpolate(points, xs[0] - 1) is None and ref.interpolate(points, xs[-1] + 1) is None
    )


def test_the_offset_at_the_last_evaluation_is_against_the_interpolated_reference(
    references: Path, tmp_path: Path
) -> None:
    run = make_run(tmp_path / "a", TINY, ((500, 3.5), (2500, 2.4)), {"config_name": "tiny"})
    check = ref.check_run(run, config_from_dict(TINY).to_dict())
    hand = 3.0 + (2.0 - 3.0) * (2500 - 1000) / (3000 - 1000)  # 2.25
    assert (check.name, check.matched_by, check.tokens) == ("tiny", "meta.json", 2500)
    assert check.run_val_loss == 2.4 and check.reference_val_loss == pytest.approx(hand)
    assert check.offset == pytest.approx(2.4 - hand) and check.offset > 0
    assert check.relative == pytest.approx((2.4 - hand) / hand)
    assert check.differs == {} and check.missing is None
    rows = dict(ref.describe(check))
    assert "0.1500 (6.7%) above it" in rows["vs reference"]
    assert "reference 2.2500" in rows["vs reference"] and "2,500 tokens" in rows["vs reference"]
    assert rows["curve keys differ"].startswith("none")


def test_a_run_past_the_reference_is_compared_at_the_references_last_point(
    references: Path, tmp_path: Path
) -> None:
    run = make_run(tmp_path / "b", TINY, ((4000, 1.9), (6000, 1.3)), {"config_name": "tiny"})
    check = ref.check_run(run, config_from_dict(TINY).to_dict())
    run_at_5000 = 1.9 + (1.3 - 1.9) * (5000 - 4000) / (6000 - 4000)  # 1.6
    assert check.tokens == 5000
    assert check.offset == pytest.approx(run_at_5000 - 1.5)
    assert "below" not in dict(ref.describe(check))["vs reference"]


def test_the_differing_keys_are_those_that_change_the_curve(references: Path, tmp_path) -> None:
    raw = {
        "model": {**TINY["model"], "n_layer": 2, "pos_emb": "rope"},
        # the same corpus file in another folder is the same data; the cache does not matter
        "data": {"path": "/elsewhere/data/shakespeare.txt", "cache_dir": "/tmp/cache"},
        "train": {"lr": 2e-3, "batch_size": 8, "seed": 1, "eval_interval": 7, "device": "cpu"},
        "sample": {"temperature": 0.1},
    }
    run = make_run(tmp_path / "c", raw, ((3000, 2.1),), {"config_name": "tiny"})
    check = ref.check_run(run, config_from_dict(raw).to_dict())
    assert check.differs == {
        "model.n_layer": [2, 1],
        "model.pos_emb": ["rope", "learned"],
        "train.batch_size": [8, 12],
        "train.lr": [2e-3, 1e-3],
    }
    assert check.offset == pytest.approx(0.1)
    line = dict(ref.describe(check))["curve keys differ"]
    assert line == (
        "model.n_layer 2 (reference 1); model.pos_emb rope (reference learned); "
        "train.batch_size 8 (reference 12); train.lr 0.002 (reference 0.001)"
    )
    other_corpus = {**raw, "data": {"path": "/elsewhere/novel.txt"}}
    assert ref.curve_differences(other_corpus, TINY)["data.path"] == [
        "novel.txt",
        "shakespeare.txt",
    ]


def test_why_there_is_no_reference(references: Path, tmp_path: Path) -> None:
    config = config_from_dict(TINY).to_dict()
    mine = make_run(tmp_path / "mine", TINY, ((1000, 3.0),), {"config_name": "mine"})
    assert "its config 'mine' is not a shipped config" in ref.check_run(mine, config).missing
    unnamed = make_run(tmp_path / "run-7", TINY, ((1000, 3.0),))
    missing = ref.check_run(unnamed, config).missing
    assert "records no config name" in missing and "tiny" in missing  # the shipped names
    small = make_run(tmp_path / "s", TINY, ((1000, 3.0),), {"config_name": "small"})
    assert (
        ref.check_run(small, config).missing
        == "shipped config 'small': not measured: too slow here"
    )
    early = make_run(tmp_path / "e", TINY, ((200, 3.9), (400, 3.7)), {"config_name": "tiny"})
    assert "(200 to 400 tokens) do not reach the reference's (1,000 to 5,000)" in (
        ref.check_run(early, config).missing
    )
    fresh = make_run(tmp_path / "f", TINY, (), {"config_name": "tiny"})
    assert ref.check_run(fresh, config).missing == "the run has no evaluation yet"
    # a run from before meta.json named its config: the folder's name, the default, is used
    old = make_run(tmp_path / "tiny", TINY, ((3000, 2.0),))
    assert ref.check_run(old, config).matched_by == "the run folder's name"
    (references / "tiny.json").write_text("{not json")
    with pytest.raises(InputError, match="reference curve .* is unreadable.*reinstall"):
        ref.check_run(old, config)


def test_info_and_compare_place_the_run_against_its_reference(
    references: Path, tmp_path: Path, capsys
) -> None:
    run = make_run(tmp_path / "a", TINY, ((500, 3.5), (2500, 2.4)), {"config_name": "tiny"})
    info = run_info(run)
    assert info["reference"]["offset"] == pytest.approx(0.15)
    assert "0.1500 (6.7%) above it" in format_info(info)
    png = tmp_path / "ref.png"
    with pytest.raises(SystemExit) as exc:
        main(["compare", str(run), "--reference", "--out", str(png), "--json"])
    out = capsys.readouterr()
    assert exc.value.code == 0, out.err
    result = json.loads(out.out)
    assert result["x"] == "tokens"  # the reference's axis, unless --x says otherwise
    (row,) = result["runs"]
    assert row["reference"]["reference_val_loss"] == pytest.approx(2.25)
    assert row["reference"]["tokens"] == 2500
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit) as exc:
        main(["compare", str(run), "--reference", "--out", str(png), "--x", "step"])
    out = capsys.readouterr()
    assert exc.value.code == 0 and "a: vs reference: val loss 2.4000 at 2,500 tokens" in out.out
    for args, message in (
        (["--reference", "--metric", "lr"], "use --metric val_loss or val_ppl"),
        ([], "at least two runs (or one with --reference)"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["compare", str(run), "--out", str(png), *args])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_reference_from_run_keeps_the_evaluations_and_how_they_were_measured(
    tmp_path: Path, references: Path
) -> None:
    raw = {**TINY, "data": {"path": "/somewhere/shakespeare.txt"}, "train": {"seed": 5}}
    meta = {"step": 5, "tokens": 6000, "elapsed_s": 12.5, "device": "cpu", "dtype": "float32"}
    run = make_run(tmp_path / "r", raw, ((1000, 3.0), (6000, 1.2), (3000, 2.0)), meta)
    content = ref.reference_from_run(run, "tiny", commit="abc", date="2026-12-01")
    assert [(p["tokens"], p["val_loss"]) for p in content["points"]] == [
        (1000, 3.0),
        (3000, 2.0),
        (6000, 1.2),
    ]
    assert content["config"]["data"]["path"] == "data/shakespeare.txt"
    assert content["measured"] | {"versions": None} == {
        "date": "2026-12-01",
        "commit": "abc",
        "device": "cpu",
        "dtype": "float32",
        "world_size": 1,
        "seed": 5,
        "steps": 5,
        "tokens": 6000,
        "elapsed_s": 12.5,
        "versions": None,
    }
    atomic_write_json(references / "tiny.json", content)
    loaded = ref.load_reference("tiny")
    assert loaded is not None and loaded.points == content["points"]
    with pytest.raises(InputError, match="no evaluation"):
        ref.reference_from_run(make_run(tmp_path / "n", TINY, ()), "tiny", commit="", date="")


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_every_shipped_config_has_its_reference_measured_with_that_config(name: str) -> None:
    reference = ref.load_reference(name)
    assert reference is not None, f"configs/references/{name}.json is missing"
    if not reference.points:
        assert reference.note and "not measured" in reference.note
        return
    shipped = load_config(name)
    # The shipped config has not changed, in any key that moves the curve, since it was measured.
    differences = ref.curve_differences(shipped.to_dict(), reference.config)
    if shipped.train.init_from:  # the run resolved the base run's path and its tokenizer
        base = differences.pop("train.init_from")[1]
        assert Path(base).parts[-2:] == Path(shipped.train.init_from).parts[-2:]
        assert differences.pop("data.tokenizer")[1] == str(Path(base) / "tokenizer.json")
        if "data.chat_template" in differences:  # pairs are rendered with the base's template
            assert differences.pop("data.chat_template")[1] == str(
                Path(base) / "chat_template.jinja"
            )
    assert differences == {}
    tc, measured = shipped.train, reference.measured
    per_step = tc.batch_size * tc.grad_accum * shipped.example_tokens  # a DPO pair is two rows
    assert measured["steps"] == tc.max_steps and measured["world_size"] == 1
    for point in reference.points:
        assert point["tokens"] == point["step"] * per_step and math.isfinite(point["val_loss"])
    assert [p["tokens"] for p in reference.points] == sorted(
        {p["tokens"] for p in reference.points}
    )
    assert reference.points[-1]["tokens"] == measured["tokens"] == tc.max_steps * per_step
    assert measured["commit"] and measured["date"] and measured["device"]


@pytest.mark.usefixtures("one_thread")
def test_a_trained_run_records_its_configs_name(small_corpus: Path, tmp_path: Path) -> None:
    raw = small_run_config(small_corpus, max_steps=4, eval_interval=4, eval_steps=1)
    train(config_from_dict(raw, name="tiny"), out_dir=tmp_path / "x", progress=False)
    assert json.loads((tmp_path / "x" / "meta.json").read_text())["config_name"] == "tiny"
    check = ref.check_run(tmp_path / "x", config_from_dict(raw).to_dict())
    assert (check.name, check.matched_by) == ("tiny", "meta.json")
    assert "do not reach the reference's" in check.missing  # 256 tokens, before its first point
    assert check.differs["model.n_layer"] == [1, 4]
