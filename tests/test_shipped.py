"""The shipped configs found by name (llmcli.config.shipped), and the one whose corpus is not
bundled: `tinystories`, run on local parquet files in the Hub dataset's format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmcli.cli import main
from llmcli.config import load_config
from llmcli.config.shipped import shipped_configs

STORY = "Once upon a time, {name} had a {thing}. {name} liked the {thing} very much. The end."


def _parquet(path: Path, names: list[str]) -> Path:
    import datasets

    things = ["ball", "dog", "red hat", "boat", "cake"]
    rows = [STORY.format(name=n, thing=things[i % 5]) for i, n in enumerate(names)]
    datasets.Dataset.from_dict({"text": rows}).to_parquet(str(path))
    return path


def test_tinystories_is_the_hub_dataset_streamed_through_byte_level_bpe() -> None:
    raw = yaml.safe_load(shipped_configs()["tinystories"].read_text())
    config = load_config("tinystories")
    assert config.data.dataset == "roneneldan/TinyStories" and config.data.path is None
    assert (config.data.split, config.data.val_split, config.data.text_column) == (
        "train",
        "validation",
        "text",
    )
    assert config.data.streaming and config.data.tokenizer == "bpe"
    assert raw["data"]["vocab_size"] == config.data.vocab_size == 4096


def test_tinystories_trains_and_samples_on_local_files_of_its_format(tmp_path, capsys) -> None:
    names = [f"Kid{i}" for i in range(600)]
    train = _parquet(tmp_path / "train.parquet", names[:500])
    val = _parquet(tmp_path / "validation.parquet", names[500:])
    out = tmp_path / "run"
    args = [
        "train", "tinystories", "--out", str(out), "--no-progress", "--threads", "1",
        *("--set", f"data.dataset={train}", "--set", f"data.val_path={val}"),
        *("--set", "data.val_split=train", "--set", "data.vocab_size=300"),
        *("--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "train.max_steps=2"),
        *("--set", "train.eval_steps=1", "--set", "train.batch_size=2"),
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 0, capsys.readouterr().err
    meta = json.loads((out / "meta.json").read_text())
    assert meta["step"] == 2 and meta["vocab_size"] == 300
    assert meta["tokenizer_training"]["kind"] == "bpe"
    assert meta["tokenizer_training"]["corpus_bytes"] is None  # a stream's size is not known
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["sample", "--checkpoint", str(out), "--prompt", "Once upon a time,",
              "--max-new-tokens", "5", "--threads", "1"])  # fmt: skip
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("Once upon a time,")
