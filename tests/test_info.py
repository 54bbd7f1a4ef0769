"""`llmcli info`: model size, training summary, versions, generation defaults (info.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import save_tiny_run

from llmcli.cli import main
from llmcli.config import config_from_dict
from llmcli.data.tokenizer import CharTokenizer
from llmcli.model.gpt import Transformer
from llmcli.runs.info import format_info, run_info
from llmcli.runs.versions import record


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    raw = {
        "model": {"n_layer": 2, "n_head": 2, "n_embed": 16, "context_length": 8},
        "sample": {"temperature": 0.5, "top_k": 7},
    }
    old = dict(record(), torch="1.0.0")
    meta = {"step": 40, "tokens": 1280, "elapsed_s": 3.5, "best_val_loss": 2.25, "best_step": 30}
    tokenizer = CharTokenizer.train(["hello world\n"])
    save_tiny_run(tmp_path / "run", tokenizer, raw, extra_meta={**meta, "versions": old})
    (tmp_path / "run" / "metrics.jsonl").write_text(
        json.dumps({"step": 30, "val_loss": 2.25}) + "\n" + json.dumps({"step": 40}) + "\n"
    )
    return tmp_path / "run"


def test_run_info_reports_size_training_and_generation(run_dir: Path) -> None:
    info = run_info(run_dir)
    model = Transformer(
        config_from_dict(
            {"model": {"n_layer": 2, "n_head": 2, "n_embed": 16, "context_length": 8}}
        ).model,
        info["model"]["vocab_size"],
    )
    # Tied embeddings are counted once.
    unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert info["model"]["parameters"] == unique
    assert info["model"]["vocab_size"] == len(set("hello world\n")) + 1  # + the end-of-text token
    assert info["training"]["steps"] == 40
    assert info["training"]["tokens"] == 1280
    assert info["training"]["best_val_loss"] == 2.25
    assert info["training"]["best_step"] == 30
    assert info["generation"]["temperature"] == 0.5
    assert info["generation"]["top_k"] == 7
    assert info["versions"]["recorded"]["torch"] == "1.0.0"
    assert info["versions"]["installed"] == record()
    assert len(info["version_warnings"]) == 1 and "torch 1.0.0" in info["version_warnings"][0]
    text = format_info(info)
    assert re.search(r"best val loss +2.2500 at step 30", text)
    assert f"{unique:,}" in text


def test_info_command_json_and_version_warning(run_dir: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--checkpoint", str(run_dir), "--json"])
    assert exit_info.value.code == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["training"]["steps"] == 40
    assert err.count("\n") == 1 and "warning: this run was made with torch 1.0.0" in err


def test_info_on_a_missing_run_exits_2(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--checkpoint", str(tmp_path / "none")])
    assert exit_info.value.code == 2
    assert "does not exist" in capsys.readouterr().err


def test_eval_warns_once_when_the_run_was_made_with_other_versions(
    run_dir: Path, tmp_path: Path, capsys
) -> None:
    text = tmp_path / "text.txt"
    text.write_text("hello world\nhello world\n")
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["eval", "--checkpoint", str(run_dir), "--data", str(text), "--json", "--device", "cpu"]
        )
    assert exit_info.value.code == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["tokens"] == len("hello world\nhello world\n") - 1
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "torch 1.0.0" in warnings[0]


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b'{"step": 40,, "tokens"', r"not valid JSON \(Expecting .* at line 1, column 13\)"),
        (b"[40, 1280]", r"holds a JSON list, not an object"),
        (b"\xff\xfe garbage", r"not UTF-8 text \(bad byte at offset 0\)"),
        (b"[" * 100_000, r"nests lists or objects too deeply"),
    ],
    ids=["not-json", "not-an-object", "not-utf8", "too-deep"],
)
def test_info_on_a_damaged_meta_json_names_it_once_and_shows_the_rest(
    run_dir: Path, capsys, caplog, content: bytes, problem: str
) -> None:
    # meta.json is informative (as for a field of the wrong type, test_readers.py): the rest of
    # the run is shown, with a warning that names the file and what is wrong with it.
    (run_dir / "meta.json").write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--checkpoint", str(run_dir), "--json"])
    assert exit_info.value.code == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model"]["n_layer"] == 2 and info["training"]["best_val_loss"] == 2.25
    assert info["training"]["tokens"] is None  # recorded only in the damaged file
    damaged = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(damaged) == 1, damaged
    assert re.search(
        rf"{re.escape(str(run_dir / 'meta.json'))} is damaged: it .*{problem}", damaged[0]
    )


def test_info_says_how_the_tokenizer_was_trained_also_after_a_resume(tmp_path, capsys) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"line {i}: a story of a fox and a dog\n" for i in range(8_000)))
    out = tmp_path / "run"
    train = [
        "train",
        "tiny",
        "--out",
        str(out),
        "--no-progress",
        "--threads",
        "1",
        *("--set", f"data.path={corpus}", "--set", "data.tokenizer=bpe"),
        *("--set", "data.vocab_size=300", "--set", "data.tokenizer_sample=64KB"),
        *("--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "train.eval_steps=1"),
        *("--set", "model.n_layer=1", "--set", "model.n_embed=32", "--set", "model.n_head=2"),
    ]
    for args in (
        [*train, "--set", "train.max_steps=2"],
        [*train, "--set", "train.max_steps=3", "--resume"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(args)
        assert exc.value.code == 0, capsys.readouterr().err
    training = json.loads((out / "meta.json").read_text())["tokenizer_training"]
    assert training["kind"] == "bpe" and training["sample"] == "64KB"
    assert 0.9 * 65536 <= training["trained_on_bytes"] <= 65536
    assert training["corpus_bytes"] == corpus.stat().st_size
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["info", "--checkpoint", str(out)])
    row = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("tokenizer")
    )
    assert re.fullmatch(
        r"tokenizer +byte-level BPE, vocab 300, trained on 6\d\.\d KiB of \d{3} KiB "
        r"\(data.tokenizer_sample 64KB\)",
        row,
    ), row
