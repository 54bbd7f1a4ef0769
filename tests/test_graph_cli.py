"""`llmcli graph` and `llmcli sae train --kind transcoder` from the command line: what they
print and write, and exit status 2 with a message naming the fix, nothing written, for bad
input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from graph_helpers import PROMPT, transcoders_for
from sae_helpers import small_run

from llmcli.cli import main
from llmcli.inspection.sae.transcoder_folder import CONFIG_FILE

pytestmark = pytest.mark.usefixtures("one_thread")


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    return small_run(tmp_path_factory.mktemp("run") / "run", small_corpus)


@pytest.fixture(scope="module")
def folder(run):
    return transcoders_for(run, run / "transcoders")  # the default folder


def test_sae_train_kind_transcoder_writes_the_set(run, tmp_path, capsys) -> None:
    out = tmp_path / "tc"
    args = ["sae", "train", "--kind", "transcoder", "--checkpoint", str(run), "--out", str(out)]
    small = ["--features", "32", "--k", "4", "--steps", "2", "--batch-tokens", "64"]
    code, stdout, err = cli(capsys, *args, *small, "--skip", "--no-progress")
    assert code == 0, err
    assert f"transcoders {out}: step 2/2" in stdout and (out / CONFIG_FILE).is_file()
    code, _, err = cli(capsys, *args, *small, "--hook", "blocks.0.mlp_out", "--no-progress")
    assert code == 2 and "--hook ('blocks.0.mlp_out') is for SAEs" in err


def test_graph_prints_the_paths_and_writes_graph_pt(run, folder, tmp_path, capsys) -> None:
    out = tmp_path / "graph.pt"
    args = ["graph", "--checkpoint", str(run), "--prompt", PROMPT, "--no-progress"]
    code, stdout, err = cli(capsys, *args, "--out", str(out))
    assert code == 0, err
    assert "exactness: logits" in stdout and f"wrote {out}" in stdout
    saved = torch.load(out, weights_only=True)
    assert saved["input_string"] == "<|endoftext|>" + PROMPT
    code, stdout, _ = cli(capsys, *args, "--json", "--max-logits", "3")
    result = json.loads(stdout)
    assert code == 0 and len(result["logits"]) == 3
    assert result["tokens"][0] == "<|endoftext|>" and result["checks"]["logits"] < 1e-5
    assert {path["logit"] for path in result["paths"]} <= {x["label"] for x in result["logits"]}
    assert all(path["nodes"][-1] == path["logit"] for path in result["paths"])
    assert result["paths"] and result["kept_nodes"] <= result["nodes"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", ""], "--prompt"),
        (["--prompt", "x" * 16], "shorten it to at most 15 tokens"),
        (["--transcoders", "{tmp}/none"], "train them with `llmcli sae train --kind transcoder"),
        (["--node-threshold", "1.5"], "--node-threshold (1.5) must be between 0 and 1"),
        (["--max-logits", "0"], "--max-logits (0) must be at least 1"),
        (
            ["--page", "{tmp}/none/g.html"],
            "the folder of --page '{tmp}/none/g.html' does not exist",
        ),
        (["--frontend", "{tmp}/none/site"], "the folder of --frontend '{tmp}/none/site' does"),
        (["--frontend", "{tmp}/site", "--slug", "a/b"], "--slug 'a/b' must be a name"),
        (
            ["--frontend", "{tmp}/broken"],
            "graph-metadata.json' cannot be read: it is not valid JSON",
        ),
        (["--frontend", "{tmp}/other"], "is not circuit-tracer's listing"),
    ],
)
def test_bad_input_exits_2_naming_the_fix_and_writes_nothing(
    run, folder, tmp_path, capsys, args, message
) -> None:
    out = tmp_path / "graph.pt"
    for name, listing in (("broken", "{not json"), ("other", '{"graphs": 3}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "graph-metadata.json").write_text(listing)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    message = message.replace("{tmp}", str(tmp_path))
    base = ["graph", "--checkpoint", str(run), "--out", str(out), "--no-progress"]
    if "--prompt" not in args:
        base += ["--prompt", PROMPT]
    code, _, err = cli(capsys, *base, *args)
    assert code == 2, err
    assert message in " ".join(err.split())
    assert not out.exists()


def test_transcoders_of_another_run_width_or_missing_a_layer_are_refused(
    run, folder, tmp_path, small_corpus, capsys
) -> None:
    other = small_run(tmp_path / "other", small_corpus, n_embed=32)
    wide = transcoders_for(other, tmp_path / "wide", steps=1)
    partial = transcoders_for(run, tmp_path / "partial", steps=1, layers="1")
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    same_width = small_run(tmp_path / "twin", small_corpus)  # another run, the same shape
    out = tmp_path / "graph.pt"
    for checkpoint, transcoders, message in (
        (run, wide, "(width 32, layers [0, 1]) do not fit run"),
        (run, partial, "lacks layer(s) 0: a graph replaces every MLP"),
        (same_width, moved, "were trained on run"),
    ):
        code, _, err = cli(
            capsys,
            "graph",
            "--checkpoint",
            str(checkpoint),
            "--transcoders",
            str(transcoders),
            "--prompt",
            PROMPT,
            "--out",
            str(out),
            "--no-progress",
        )
        assert code == 2, err
        assert message in " ".join(err.split()) and not out.exists()
    # `sae eval` measures a set on another run's weights, saying so; one that cannot read them
    # is refused as the graph refuses it.
    sae_eval = ["sae", "eval", "--steps", "1", "--no-progress", "--json", "--sae"]
    code, out_text, err = cli(capsys, *sae_eval, str(moved), "--checkpoint", str(same_width))
    assert code == 0, err
    assert "were trained on run" in err and "the figures measure them on these weights" in err
    assert json.loads(out_text)["ce_clean"] > 0
    code, _, err = cli(capsys, *sae_eval, str(wide), "--checkpoint", str(run))
    assert code == 2 and "(width 32, layers [0, 1]) do not fit run" in " ".join(err.split())


def test_sae_features_reads_one_layers_transcoder_features(run, folder, capsys) -> None:
    base = ["sae", "features", "--sae", str(folder), "--steps", "1", "--batch-size", "4"]
    code, stdout, err = cli(capsys, *base, "--layer", "1", "--json", "--no-progress")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["hook"] == "blocks.1.mlp_in" and len(report["features"]) == 64
    assert any(f["contexts"] for f in report["features"])
    assert (folder / "features_layer_1.html").is_file()
    code, _, err = cli(capsys, *base, "--no-progress")
    assert code == 2 and "no --layer: give the layer" in " ".join(err.split())
