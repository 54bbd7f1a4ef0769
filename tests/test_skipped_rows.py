"""Rows too long for the context (GRPO's prompts, DPO's pairs, chat's conversations) are named
when they are left out, the first few by file and line, with the limit and what to do; a split
left with none exits 2 with the same words. Driven through `llmcli train`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from chat_helpers import save_chat_run

from llmcli.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = "a very long message " * 3  # over 32 tokens of a char tokenizer


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("skipped")
    return save_chat_run(folder / "base", n_layer=1, n_embed=16, context_length=32)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def reply(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


ROWS = {
    "prompts": lambda text: {"prompt": user(text), "answer": "ok"},
    "preference": lambda text: {
        "prompt": user(text),
        "chosen": reply("yes"),
        "rejected": reply("no"),
    },
    "chat": lambda text: {"messages": user(text) + reply("ok")},
}
TRAIN = {
    "prompts": {"objective": "grpo", "reward": "exact", "group_size": 2},
    "preference": {"objective": "dpo"},
    "chat": {},
}
WHAT = {"prompts": "prompt", "preference": "pair", "chat": "conversation"}


def write_config(base: Path, folder: Path, fmt: str, train_texts: list[str]) -> Path:
    def jsonl(name: str, texts: list[str]) -> str:
        path = folder / name
        path.write_text("".join(json.dumps(ROWS[fmt](t)) + "\n" for t in texts))
        return str(path)

    raw = {
        "model": {"dropout": 0.0},
        "data": {
            "format": fmt,
            "path": jsonl("train.jsonl", train_texts),
            "val_path": jsonl("val.jsonl", ["hi"]),
        },
        "train": {
            "init_from": str(base),
            "device": "cpu",
            "batch_size": 2,
            "max_steps": 1,
            "eval_interval": 1,
            "eval_steps": 1,
            **TRAIN[fmt],
        },
        "sample": {"max_new_tokens": 4, "temperature": 1.0},
    }
    config = folder / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    return config


def train(capsys, config: Path, out: Path) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(config), "--out", str(out), "--no-progress"])
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["prompts", "preference", "chat"])
def test_rows_left_out_are_named_with_the_limit_and_the_fix(base, tmp_path, capsys, fmt):
    texts = ["hi", LONG, "ho", LONG, "yo", LONG, LONG, LONG]  # lines 2, 4, 6, 7, 8 too long
    code, err = train(capsys, write_config(base, tmp_path, fmt, texts), tmp_path / "run")
    assert code == 0, err
    train_file = tmp_path / "train.jsonl"
    places = ", ".join(f"{train_file} line {n}" for n in (2, 4, 6))
    flat = " ".join(err.split())  # as written, wrapped or not
    assert f"5 {WHAT[fmt]}s of the train split skipped as " in flat
    assert "model.context_length" in flat and ("(32 tokens)" in flat or "(33 tokens)" in flat)
    assert f": {places} and 2 more. To learn from them, raise model.context_length" in flat
    if fmt != "prompts":  # the counts' line: one row, one noun
        assert f"validation 1 {WHAT[fmt]}: 1 kept" in flat


@pytest.mark.parametrize("fmt", ["prompts", "preference", "chat"])
def test_a_split_with_nothing_left_exits_2_naming_its_rows(base, tmp_path, capsys, fmt):
    code, err = train(capsys, write_config(base, tmp_path, fmt, [LONG]), tmp_path / "run")
    assert code == 2 and "Traceback" not in err
    flat = " ".join(err.split())
    assert f"error: nothing left to learn from: 1 {WHAT[fmt]} of the train split skipped" in flat
    assert f"{tmp_path / 'train.jsonl'} line 1. To learn from them, raise" in flat
    assert not (tmp_path / "run").exists()
