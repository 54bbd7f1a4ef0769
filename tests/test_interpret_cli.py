"""`llmcli lens`, `patch` and `attribute` (llmcli/cli/interpret.py) on a saved run: their JSON
against the library's computations on the loaded model, the files they write, and bad input."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from attention_helpers import CORPUS
from conftest import save_tiny_run

from llmcli.data.tokenizer import CharTokenizer
from llmcli.runs.loading import load_run

pytestmark = pytest.mark.usefixtures("one_thread")

CLEAN, CORRUPT = "All:\nSpeak, sir.", "All:\nSpeak, her."


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tok = CharTokenizer.train([CORPUS])
    model = {"n_layer": 2, "n_head": 4, "n_embed": 32, "context_length": 16}
    root = tmp_path_factory.mktemp("interpret")
    return save_tiny_run(root / "run", tok, {"model": model}, sharpen=6.0)


def cli(args: list[str], capsys) -> tuple[int, str, str]:
    from llmcli.cli import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def logits_of(run_dir, text: str) -> torch.Tensor:
    run = load_run(run_dir)
    with torch.no_grad():
        return run.model(torch.tensor([run.tokenizer.encode(text)]))[0][0]  # (T, V)


def is_png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lens(run_dir, capsys) -> None:
    code, out, err = cli(
        ["lens", "--checkpoint", str(run_dir), "--prompt", CLEAN, "--json"], capsys
    )
    assert code == 0, err
    data = json.loads(out)
    T = len(CLEAN)
    assert data["layers"] == ["embed", "0", "1"]
    assert data["tokens"] == list(CLEAN)
    assert np.array(data["logprobs"]).shape == (3, T - 1)
    assert np.array(data["top_tokens"]).shape == (3, T)
    logp = torch.log_softmax(logits_of(run_dir, CLEAN).double(), -1)
    ids = torch.tensor(load_run(run_dir).tokenizer.encode(CLEAN))
    expected = logp[torch.arange(T - 1), ids[1:]].numpy()
    np.testing.assert_allclose(data["logprobs"][-1], expected, atol=1e-5)
    folder = run_dir / "lens"
    assert json.loads((folder / "lens.json").read_text()) == data
    assert is_png(folder / "lens.png")
    assert f"wrote {folder}/: lens.json, lens.png" in err
    # The run's viewer page is rewritten with the lens beside what it showed.
    page = run_dir / "attention" / "attention.html"
    assert f"updated the viewer: {page}" in err
    assert '"id": "lens"' in page.read_text(encoding="utf-8")
    code, out, err = cli(["lens", "--checkpoint", str(run_dir), "--prompt", CLEAN], capsys)
    assert code == 0 and out.splitlines()[1].split()[:2] == ["layer", "loss"]


def test_patch(run_dir, tmp_path, capsys) -> None:
    args = ["patch", "--checkpoint", str(run_dir), "--clean", CLEAN, "--corrupt", CORRUPT]
    args += ["--answer", "e", "--wrong", "s", "--out", str(tmp_path / "p"), "--json"]
    code, out, err = cli(args, capsys)
    assert code == 0, err
    data = json.loads(out)
    tok = load_run(run_dir).tokenizer
    a, w = tok.encode("e")[0], tok.encode("s")[0]
    for name, text in (("clean", CLEAN), ("corrupt", CORRUPT)):
        last = logits_of(run_dir, text)[-1]
        assert data[name] == pytest.approx(float(last[a] - last[w]), abs=1e-5)
    T = len(CLEAN)
    shapes = {k: np.array(data[k]).shape for k in ("resid_pre", "attn_out", "mlp_out", "head_out")}
    assert shapes == {
        "resid_pre": (2, T),
        "attn_out": (2, T),
        "mlp_out": (2, T),
        "head_out": (2, 4),
    }
    # Before the first changed token both prompts are the same: patching there changes nothing.
    assert np.abs(np.array(data["resid_pre"])[:, :12]).max() < 1e-4
    assert data["clean_prompt"] == CLEAN and data["corrupt_prompt"] == CORRUPT
    assert json.loads((tmp_path / "p" / "patch.json").read_text()) == data
    assert is_png(tmp_path / "p" / "patch.png")
    assert not (run_dir / "patch").exists()  # --out, not the run's folder
    assert "updated the viewer" not in err  # the run's page does not see a result elsewhere


def test_attribute(run_dir, capsys) -> None:
    args = ["attribute", "--checkpoint", str(run_dir), "--prompt", CLEAN, "--answer", "e"]
    code, out, err = cli([*args, "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    tok = load_run(run_dir).tokenizer
    last = logits_of(run_dir, CLEAN)[-1]
    assert data["logit_diff"] == pytest.approx(float(last[tok.encode("e")[0]]), abs=1e-5)
    parts = data["embed"] + np.sum(data["heads"]) + np.sum(data["mlp"]) + data["rest"]
    assert parts == pytest.approx(data["logit_diff"], abs=1e-4)
    assert data["wrong"] is None and data["prompt"] == CLEAN
    folder = run_dir / "attribute"
    assert json.loads((folder / "attribution.json").read_text()) == data
    assert is_png(folder / "attribution.png")
    code, out, err = cli(args, capsys)
    assert code == 0 and "sum of the parts" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["patch", "--clean", CLEAN, "--corrupt", "All:\nSpeak.", "--answer", "e"],
            r"--clean is 16 tokens long and --corrupt 11",
        ),
        (
            ["patch", "--clean", CLEAN, "--corrupt", CORRUPT, "--answer", "ea"],
            r"--answer must be exactly one token, but 'ea' is 2 tokens \('e', 'a'\)",
        ),
        (
            ["attribute", "--prompt", CLEAN, "--answer", "e", "--wrong", "sir"],
            r"--wrong must be exactly one token.*3 tokens \('s', 'i', 'r'\)",
        ),
        (
            ["lens", "--prompt", CLEAN + "a"],
            "--prompt is 17 tokens long but .*context_length is 16",
        ),
        (["lens", "--prompt", ""], "--prompt is empty"),
        (["attribute", "--prompt", "", "--answer", "e"], "--prompt is empty"),
        (["patch", "--clean", CLEAN, "--corrupt", CLEAN, "--answer", "e"], "nothing to restore"),
        (["lens", "--prompt", "A"], "at least 2 tokens"),
    ],
)
def test_bad_input_exits_2(run_dir, capsys, args, message) -> None:
    code, out, err = cli([args[0], "--checkpoint", str(run_dir), *args[1:]], capsys)
    assert code == 2, err
    assert out == ""
    assert re.search(message, err.split("error: ", 1)[1].replace("\n", " ")), err
