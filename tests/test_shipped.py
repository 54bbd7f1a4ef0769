"""The shipped configs found by name (llmcli.config.shipped), and the one whose corpus is not
bundled: `tinystories`, run on local parquet files in the Hub dataset's format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmcli.cli import main
from llmcli.config import load_config
from llmcli.config.shipped import shipped_configs, shipped_data, shipped_dir

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


def test_shipped_data_is_found_from_any_folder_and_a_local_file_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bundled = shipped_dir("corpora")
    assert shipped_data("data/dpo-val.jsonl") == bundled / "dpo-val.jsonl"
    assert shipped_data("data/nothing.jsonl") == Path("data/nothing.jsonl")
    assert shipped_data("elsewhere/dpo-val.jsonl") == Path("elsewhere/dpo-val.jsonl")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dpo-val.jsonl").write_text("{}\n", encoding="utf-8")
    assert shipped_data("data/dpo-val.jsonl") == Path("data/dpo-val.jsonl")


@pytest.mark.parametrize(
    ("name", "what"), [("dpo-val.jsonl", "pairs"), ("grpo-val.jsonl", "prompts")]
)
def test_eval_reads_the_docs_data_files_from_an_empty_folder(
    tmp_path, monkeypatch, capsys, name, what
):
    from chat_helpers import save_chat_run

    run_dir = save_chat_run(tmp_path / "chat", seed=6, sharpen=8.0)
    results = []
    for data in (str(shipped_dir("corpora") / name), f"data/{name}"):
        monkeypatch.chdir(tmp_path / "chat" if data.startswith("/") else tmp_path)
        with pytest.raises(SystemExit) as exit_:
            main(["eval", "--checkpoint", str(run_dir), "--data", data, "--json"])
        out = capsys.readouterr()
        assert exit_.value.code == 0, out.err
        result = json.loads(out.out)
        results.append({k: v for k, v in result.items() if "seconds" not in k and k != "elapsed_s"})
    assert results[0] == results[1]
    assert results[0]["data"] == str(shipped_dir("corpora") / name)
