"""Bad files a newcomer hands llmcli, second pass: each exits 2 with `error:` naming the file,
what is wrong and the fix, never a traceback, another exit status or nothing at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from chat_helpers import save_chat_run

from llmcli.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bad-files")
    return save_chat_run(folder / "base", n_layer=1, n_embed=16, context_length=32)


def run_cli(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main([*args])
    return exit_.value.code, capsys.readouterr().err


def config_file(folder: Path, base: Path, data: dict, train: dict) -> Path:
    raw = {
        "data": data,
        "train": {"init_from": str(base), "device": "cpu", "max_steps": 1, **train},
        "sample": {"max_new_tokens": 4, "temperature": 1.0},
    }
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"\x89PNG\r\n\x1a\n" + bytes(range(256)), "line 1 is not UTF-8 text (byte 0x89 at"),
        (b"\x00" * 64 + b"\n", "line 1 holds NUL bytes: is it a binary file?"),
    ],
    ids=["png", "nul"],
)
def test_a_binary_file_of_pairs_is_said_to_be_binary_and_where(
    base, tmp_path, capsys, content: bytes, said: str
) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_bytes(content)
    data = {"format": "preference", "path": str(pairs), "val_path": str(pairs)}
    config = config_file(tmp_path, base, data, {"objective": "dpo"})
    code, err = run_cli(capsys, "train", str(config), "--out", str(tmp_path / "run"))
    assert code == 2 and "Traceback" not in err
    flat = " ".join(err.split())
    assert f"error: {pairs} {said}" in flat and "holds no preference pairs" not in flat
    assert "is it a binary file?" in flat
    assert not (tmp_path / "run").exists()


def test_a_reward_file_that_exits_at_import_is_an_error_not_the_runs_end(
    base, tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text(
        "import sys\ndef score(p, c, a):\n    return 1.0\nsys.exit(3)\n"
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "spell ab", "answer": "a-b"}) + "\n")
    data = {"format": "prompts", "path": str(prompts), "val_path": str(prompts)}
    train = {"objective": "grpo", "reward": "rewards.py:score", "group_size": 2, "batch_size": 1}
    config = config_file(tmp_path, base, data, train)
    code, err = run_cli(capsys, "train", str(config), "--out", str(tmp_path / "run"))
    assert code == 2, err
    flat = " ".join(err.split())
    assert "error: train.reward: importing 'rewards.py' called sys.exit(3): a reward file" in flat
    assert 'under `if __name__ == "__main__":`' in flat and "Traceback" not in flat


def test_export_merge_on_a_run_without_adapters_has_nothing_to_merge(base, tmp_path, capsys):
    args = ("export", "--checkpoint", str(base), "--out", str(tmp_path / "hf"))
    code, err = run_cli(capsys, *args, "--merge")
    assert code == 2
    flat = " ".join(err.split())
    assert flat.startswith(
        f"error: --merge folds a LoRA run's adapters into its weights, and '{base}'"
    )
    assert "there is nothing to merge. Leave out --merge" in flat
    assert not (tmp_path / "hf").exists()
    code, _ = run_cli(capsys, *args)  # without it, the export it was
    assert code == 0 and (tmp_path / "hf" / "config.json").is_file()
