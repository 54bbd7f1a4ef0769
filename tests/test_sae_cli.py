"""`llmcli sae train | eval | features`, `sample --steer` and `eval --ablate-feature` from the
command line: what they print, what they write, and exit status 2 with a message for bad input."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest
from sae_helpers import HOOK, small_run

from llmcli.claim import LOCK_FILE, claimed
from llmcli.cli import main
from llmcli.inspection.sae.folder import CFG_FILE, WEIGHTS_FILE

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = ["--features", "32", "--k", "4", "--batch-tokens", "64", "--no-progress"]


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    return small_run(tmp_path_factory.mktemp("run") / "run", small_corpus)


@pytest.fixture(scope="module")
def folder(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("sae") / "sae"
    args = ["sae", "train", "--checkpoint", str(run), "--hook", HOOK, "--steps", "4"]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--out", str(out), *SMALL])
    assert exc.value.code == 0
    return out


def test_train_prints_where_it_got_to_and_writes_the_folder(run, tmp_path, capsys) -> None:
    out = tmp_path / "sae"
    code, stdout, _ = cli(
        capsys,
        "sae",
        "train",
        "--checkpoint",
        str(run),
        "--hook",
        HOOK,
        "--steps",
        "2",
        "--out",
        str(out),
        *SMALL,
    )
    assert code == 0, stdout
    assert f"SAE {out}: step 2/2, 128 activations" in stdout
    assert "explained variance" in stdout and (out / CFG_FILE).is_file()
    assert (out / WEIGHTS_FILE).is_file()
    code, _, err = cli(
        capsys,
        "sae",
        "train",
        "--checkpoint",
        str(run),
        "--hook",
        HOOK,
        "--steps",
        "3",
        "--out",
        str(out),
        "--resume",
        *SMALL,
    )
    assert code == 0 and "resuming the SAE" in err


def test_a_second_train_into_a_folder_being_written_exits_2_naming_the_writer(
    run, tmp_path, capsys
) -> None:
    out = tmp_path / "sae"
    args = ["sae", "train", "--checkpoint", str(run), "--hook", HOOK, "--steps", "2"]
    assert cli(capsys, *args, "--out", str(out), *SMALL)[0] == 0
    with claimed(out / LOCK_FILE, "the SAE folder"):  # as a live `sae train` holds it
        files = sorted((p.name, p.read_bytes()) for p in out.iterdir() if p.is_file())
        for extra in ([], ["--overwrite"], ["--resume"]):
            code, _, err = cli(capsys, *args, "--out", str(out), *SMALL, *extra)
            assert code == 2, err
            assert f"the SAE folder '{out}' is being written by process {os.getpid()} " in err
            assert "--out DIR" in " ".join(err.split())
        assert sorted((p.name, p.read_bytes()) for p in out.iterdir() if p.is_file()) == files
    code, _, err = cli(capsys, *args[:-1], "3", "--out", str(out), "--resume", *SMALL)
    assert code == 0 and "resuming the SAE" in err


def test_eval_prints_the_figures_and_json(folder, capsys) -> None:
    code, out, _ = cli(capsys, "sae", "eval", "--sae", str(folder), "--steps", "1", "--no-progress")
    assert code == 0 and "ce_recovered" in out and "mean L0" in out
    code, out, _ = cli(
        capsys, "sae", "eval", "--sae", str(folder), "--steps", "1", "--json", "--no-progress"
    )
    figures = json.loads(out)
    assert code == 0 and figures["hook"] == HOOK and 0 <= figures["l0"] <= 4


def test_features_prints_one_feature_and_writes_the_page(folder, capsys) -> None:
    code, out, err = cli(
        capsys,
        "sae",
        "features",
        "--sae",
        str(folder),
        "--feature",
        "3",
        "--steps",
        "1",
        "--no-progress",
    )
    assert code == 0 and "feature 3: density" in out
    assert (folder / "features.html").is_file() and "features.html" in err
    code, out, _ = cli(
        capsys,
        "sae",
        "features",
        "--sae",
        str(folder),
        "--steps",
        "1",
        "--json",
        "--no-page",
        "--no-progress",
    )
    assert code == 0 and len(json.loads(out)["features"]) == 32
    code, out, _ = cli(
        capsys,
        "sae",
        "features",
        "--sae",
        str(folder),
        "--steps",
        "1",
        "--no-page",
        "--no-progress",
    )
    assert code == 0 and "the 20 densest features" in out


def test_sample_steer_and_eval_ablate_feature(run, folder, capsys) -> None:
    common = ["--checkpoint", str(run), "--temperature", "0", "--max-new-tokens", "10"]
    code, plain, _ = cli(capsys, "sample", *common, "--prompt", "the ")
    code2, steered, _ = cli(
        capsys, "sample", *common, "--prompt", "the ", "--steer", f"{folder}:3=30"
    )
    assert code == code2 == 0 and plain != steered
    code, out, _ = cli(
        capsys,
        "eval",
        "--checkpoint",
        str(run),
        "--steps",
        "1",
        "--no-progress",
        "--ablate-feature",
        f"{folder}:3",
    )
    assert code == 0 and f"SAE features removed: {folder}:3" in out


def test_interactive_sampling_steers_as_sample_does(run, folder, capsys, monkeypatch) -> None:
    common = ["--checkpoint", str(run), "--temperature", "0", "--max-new-tokens", "10"]
    steer = ["--steer", f"{folder}:3=30"]
    code, steered, _ = cli(capsys, "sample", *common, "--prompt", "the ", *steer)
    monkeypatch.setattr(sys, "stdin", io.StringIO("the \n"))
    code2, answered, _ = cli(capsys, "sample", *common, "--interactive", *steer)
    monkeypatch.setattr(sys, "stdin", io.StringIO("the \n"))
    code3, plain, _ = cli(capsys, "sample", *common, "--interactive")
    assert code == code2 == code3 == 0
    assert steered == "the " + answered and answered != plain


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["sae", "train", "--hook", "blocks.9.resid_post", "--steps", "1"], "is not a hook point"),
        (["sae", "train", "--hook", HOOK, "--k", "0"], "--k (0) must be at least 1"),
        (["sae", "eval", "--sae", "nowhere"], "holds no cfg.json"),
        (["sae", "features", "--feature", "99", "--steps", "1"], "--feature 99"),
        (["sample", "--steer", "x", "--max-new-tokens", "2"], "write SAE_DIR:FEATURE=SCALE"),
        (["eval", "--ablate-feature", "{folder}:1=2", "--steps", "1"], "write SAE_DIR:FEATURE"),
    ],
)
def test_bad_input_exits_2_with_a_message(run, folder, capsys, args, words) -> None:
    args = [a.format(folder=folder) for a in args]
    if args[0] != "sae" or args[1] == "train":
        args += ["--checkpoint", str(run)]
    elif "--sae" not in args:
        args += ["--sae", str(folder)]
    code, _, err = cli(capsys, *args)
    assert code == 2 and words in err and "Traceback" not in err, err
