"""`llmcli compare` (llmcli/runs/compare.py): curves of several runs in one PNG, and a table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import small_run_config

import llmcli.runs.compare
from llmcli.cli import main
from llmcli.config import config_from_dict
from llmcli.errors import InputError
from llmcli.runs.compare import compare_runs, curves_figure, format_table
from llmcli.runs.metrics import best_eval, read_metrics
from llmcli.training.loop import train

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs(small_corpus: Path) -> Path:
    """Two tiny trained runs that differ in model.n_head only."""
    root = small_corpus.parent
    for n_head in (2, 4):
        raw = small_run_config(small_corpus, max_steps=12, eval_interval=4, eval_steps=2)
        raw["model"]["n_head"] = n_head
        train(config_from_dict(raw), out_dir=root / f"heads-{n_head}", progress=False)
    return root


def cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_compare_draws_the_curves_and_lists_only_the_differing_keys(runs, capsys) -> None:
    png = runs / "cmp.png"
    code, out, err = cli(capsys, "compare", runs / "heads-*", "--out", png, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["differing_keys"] == ["model.n_head"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for row in result["runs"]:
        records = read_metrics(Path(row["run"]) / "metrics.jsonl")
        assert (row["best_val_loss"], row["best_step"]) == best_eval(records)
        assert row["steps"] == 12 and row["tokens"] == 12 * 4 * 16
        assert row["differs"] == {"model.n_head": int(Path(row["run"]).name.split("-")[1])}
    table = format_table(compare_runs([str(runs / "heads-2"), str(runs / "heads-4")]))
    runs_part, keys_part = table.split("\n\n")
    assert [line.split()[0] for line in runs_part.splitlines()[1:]] == ["heads-2", "heads-4"]
    assert keys_part.splitlines()[1].split() == ["model.n_head", "2", "4"]
    for row in result["runs"]:  # tokens over the run's whole time (meta.json's elapsed_s)
        meta = json.loads((Path(row["run"]) / "meta.json").read_text())
        assert row["elapsed_s"] == meta["elapsed_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(12 * 4 * 16 / meta["elapsed_s"])
    assert "tokens/s" in runs_part.splitlines()[0].split() and "tok/run-s" not in runs_part


def test_every_metric_and_axis_draws_each_runs_records(runs, monkeypatch) -> None:
    figures = []

    def keep(*args, **kwargs):  # the figure compare_runs saves, kept to read back
        figures.append(curves_figure(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(llmcli.runs.compare, "curves_figure", keep)
    labels = {"step": "step", "tokens": "tokens", "elapsed_s": "seconds of training"}
    logged = {
        name: [
            json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()
        ]
        for name in ("heads-2", "heads-4")
    }
    for metric, kind in (
        ("train_loss", "train"),
        ("lr", "train"),
        ("grad_norm", "train"),
        ("val_ppl", "eval"),
        ("tok_per_s", "train"),
    ):
        for x in ("step", "tokens", "elapsed_s"):
            result = compare_runs([str(runs / "heads-*")], metric=metric, x=x, out=runs / "m.png")
            assert result.picture is not None
            assert result.picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            ax = figures[-1].axes[0]
            assert (ax.get_xlabel(), ax.get_ylabel()) == (labels[x], metric)
            assert [line.get_label() for line in ax.lines] == ["heads-2", "heads-4"]
            for line, records in zip(ax.lines, logged.values(), strict=True):
                want = [(r[x], r[metric]) for r in records if r["kind"] == kind]
                assert len(want) == (6 if kind == "train" else 3)  # 12 steps, log 2, eval 4
                got = list(zip(line.get_xdata(), line.get_ydata(), strict=True))
                assert got == want, (metric, x, line.get_label())
    assert len(figures) == 15


def test_bad_input_exits_2_naming_the_folder_or_metric(runs, tmp_path, capsys) -> None:
    (tmp_path / "not-a-run").mkdir()
    cases = [
        ((runs / "heads-2", tmp_path / "not-a-run"), "not-a-run' is not a run directory"),
        ((runs / "heads-2", tmp_path / "nothing-*"), "matches no run directory"),
        ((runs / "heads-2",), "at least two runs"),
        ((runs / "heads-*", "--metric", "bleu"), "--metric 'bleu' is not one of"),
        ((runs / "heads-*", "--x", "epoch"), "--x 'epoch' is not one of"),
    ]
    for args, message in cases:
        code, _, err = cli(capsys, "compare", *args)
        assert code == 2 and message in err and "Traceback" not in err, (args, err)


def test_a_metric_a_run_never_recorded_is_named(runs, tmp_path) -> None:
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.yaml").write_text((runs / "heads-2" / "config.yaml").read_text())
    records = [r for r in read_metrics(runs / "heads-2" / "metrics.jsonl")]
    for r in records:
        r.pop("grad_norm", None)  # a run from before llmcli logged gradient norms
    (old / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(InputError, match=r"metric 'grad_norm' .* of: .*old"):
        compare_runs([str(runs / "heads-2"), str(old)], metric="grad_norm")


def test_a_picture_only_when_asked_and_a_replaced_one_is_named(
    runs, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "compare", runs / "heads-*", "--json")
    assert code == 0 and json.loads(out)["picture"] is None
    assert list(tmp_path.iterdir()) == []  # --json without --out draws nothing
    code, out, err = cli(capsys, "compare", runs / "heads-*")
    assert code == 0 and out.splitlines()[-1] == "wrote compare.png" and "replaced" not in err
    first = (tmp_path / "compare.png").read_bytes()
    assert first[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "compare.png").write_bytes(b"an earlier picture")
    code, out, err = cli(capsys, "compare", runs / "heads-*", "--json", "--out", "compare.png")
    assert code == 0 and json.loads(out)["picture"] == "compare.png"
    assert "compare.png was there already: replaced it" in err
    assert (tmp_path / "compare.png").read_bytes()[:8] == first[:8]


def test_a_run_of_one_point_is_drawn_with_a_marker(runs, tmp_path) -> None:
    records = read_metrics(runs / "heads-2" / "metrics.jsonl")
    train = [r for r in records if r.get("kind") == "train"]
    many = [dict(train[0], step=s, train_loss=3.0 - s / 100) for s in range(1, 121)]
    curves = {tmp_path / "one": train[:1], tmp_path / "many": many}
    lines = curves_figure(curves, "train_loss", "step").axes[0].lines
    one, long = lines
    assert list(one.get_xdata()) == [train[0]["step"]]
    assert list(one.get_ydata()) == [train[0]["train_loss"]]
    assert one.get_marker() == "o" and one.get_markersize() > 0  # visible without a line
    assert long.get_marker() in ("None", None, "")  # a long curve is a plain line
    assert len(long.get_xdata()) == 120


def test_a_run_that_never_evaluated_is_pointed_at_train_loss(runs, tmp_path, capsys) -> None:
    early = tmp_path / "early"
    early.mkdir()
    (early / "config.yaml").write_text((runs / "heads-2" / "config.yaml").read_text())
    records = [r for r in read_metrics(runs / "heads-2" / "metrics.jsonl") if "val_loss" not in r]
    (early / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code, _, err = cli(capsys, "compare", runs / "heads-2", early, "--out", tmp_path / "c.png")
    assert code == 2
    flat = " ".join(err.split())
    assert (
        f"error: metric 'val_loss' (against step) is not in the metrics.jsonl of: {early}" in flat
    )
    assert "a run stopped before its first has none). Every run records train_loss: " in flat
    assert flat.endswith("--metric train_loss.")
    code, out, _ = cli(capsys, "compare", runs / "heads-2", early, "--metric", "train_loss",
                       "--out", tmp_path / "c.png")  # fmt: skip
    assert code == 0 and (tmp_path / "c.png").is_file()
