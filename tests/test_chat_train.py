"""Fine-tuning on conversations (llmcli/training/init_from.py, the chat branch of run.py and
evaluate.py): `train.init_from` from a run directory, the new embedding rows, a resumed
fine-tune bitwise equal to an uninterrupted one, and bad input through `llmcli train`.

The base run is a 1-layer model of width 16 on a char vocabulary (tests/chat_helpers.py), so a
fine-tune of a dozen steps takes about a second on one thread.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chat_helpers import CHARS, save_chat_run
from conftest import save_tiny_run

from llmcli.config import Config, config_from_dict, dump_yaml
from llmcli.data.chat_template import CHAT_TOKENS, DEFAULT_TEMPLATE, TEMPLATE_FILE
from llmcli.data.tokenizer import CharTokenizer
from llmcli.data.tokens import prepare_data
from llmcli.model.gpt import Transformer
from llmcli.runs.directory import STATE_FILE
from llmcli.runs.formats import load_state, read_weights
from llmcli.runs.info import format_info, run_info
from llmcli.runs.loading import load_run, load_tokenizer_file
from llmcli.training.distributed import DistInfo
from llmcli.training.evaluate import evaluate_loss
from llmcli.training.init_from import load_init_weights, resolve_init_from
from llmcli.training.loop import train
from llmcli.training.precision import Precision

pytestmark = pytest.mark.usefixtures("one_thread")

BASE_MODEL = {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 32}


def conversations(n: int) -> list[list[dict[str, str]]]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [
        [
            {"role": "user", "content": f"spell {letters[i % 26]}{letters[(3 * i) % 26]}"},
            {"role": "assistant", "content": f"{letters[i % 26]}-{letters[(3 * i) % 26]}"},
        ]
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A plain-text run: a char tokenizer without chat tokens, tied embeddings."""
    return save_tiny_run(
        tmp_path_factory.mktemp("base") / "run", CharTokenizer(CHARS), {"model": BASE_MODEL}
    )


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("chat")
    rows = conversations(40)
    return write_jsonl(folder / "train.jsonl", rows[:32]), write_jsonl(
        folder / "val.jsonl", rows[32:]
    )


def fine_tune_config(base: Path, files: tuple[Path, Path], **train: object) -> Config:
    raw = {
        "data": {
            "format": "chat",
            "path": str(files[0]),
            "val_path": str(files[1]),
            "cache_dir": str(files[0].parent / "cache"),
        },
        "train": {
            "init_from": str(base),
            "device": "cpu",
            "batch_size": 4,
            "max_steps": 12,
            "warmup_steps": 2,
            "eval_interval": 4,
            "eval_steps": 2,
            "log_interval": 2,
            "seed": 3,
            **train,
        },
    }
    return config_from_dict(raw, name="sft")


def test_init_from_a_run_takes_its_shape_and_grows_the_embedding_by_the_mean_row(
    base: Path, chat_files: tuple[Path, Path]
) -> None:
    config = fine_tune_config(base, chat_files)
    config.model = dataclasses.replace(config.model, n_embed=64, dropout=0.25)
    resolved = resolve_init_from(config)
    assert dataclasses.asdict(resolved.model) == {
        **dataclasses.asdict(load_run(base).config.model),
        "dropout": 0.25,  # the fine-tune's own
    }
    assert resolved.data.tokenizer == str(base.resolve() / "tokenizer.json")
    assert resolved.train.init_from == str(base.resolve())

    data = prepare_data(resolved.data, resolved.model.context_length)
    old = load_tokenizer_file(base)
    grown = data.tokenizer
    assert grown.vocab_size == old.vocab_size + len(CHAT_TOKENS)
    assert grown.encode("Spell cat.\nAnd dog?") == old.encode("Spell cat.\nAnd dog?")
    model = Transformer(resolved.model, grown.vocab_size)
    load_init_weights(model, resolved.train.init_from)
    before = read_weights(base / "best.safetensors")[0]
    rows = before["wte.weight"].numpy()  # (V0, C)
    after = model.wte.weight.detach().numpy()  # (V0 + 4, C)
    assert np.array_equal(after[: len(rows)], rows)
    for new in after[len(rows) :]:
        np.testing.assert_allclose(new, rows.mean(axis=0), rtol=0, atol=1e-7)
    assert model.lm_head.weight is model.wte.weight  # tied: the head grew with it
    for name, tensor in before.items():
        if name != "wte.weight":
            assert torch.equal(model.state_dict()[name], tensor), name


def test_an_untied_head_grows_too_and_a_chat_base_passes_its_template_on(
    tmp_path: Path, chat_files: tuple[Path, Path]
) -> None:
    untied = save_tiny_run(
        tmp_path / "untied",
        CharTokenizer(CHARS),
        {"model": {**BASE_MODEL, "tie_embeddings": False}},
    )
    resolved = resolve_init_from(fine_tune_config(untied, chat_files))
    assert resolved.data.chat_template is None  # a plain-text base: the built-in template
    vocab = prepare_data(resolved.data, 32).tokenizer.vocab_size
    model = Transformer(resolved.model, vocab)
    load_init_weights(model, str(untied))
    head = read_weights(untied / "best.safetensors")[0]["lm_head.weight"].numpy()
    grown = model.lm_head.weight.detach().numpy()
    assert np.array_equal(grown[: len(head)], head)
    np.testing.assert_allclose(grown[len(head) :], np.tile(head.mean(0), (4, 1)), atol=1e-7)

    chat_base = save_chat_run(tmp_path / "chat", **BASE_MODEL)
    (chat_base / TEMPLATE_FILE).write_text(DEFAULT_TEMPLATE.replace("<|end|>\\n", "<|end|>"))
    resolved = resolve_init_from(fine_tune_config(chat_base, chat_files))
    assert resolved.data.chat_template == str(chat_base.resolve() / TEMPLATE_FILE)
    data = prepare_data(resolved.data, 32)
    assert data.tokenizer.vocab_size == load_tokenizer_file(chat_base).vocab_size  # had them


def test_a_resumed_fine_tune_is_bitwise_the_uninterrupted_one(
    base: Path, chat_files: tuple[Path, Path], tmp_path: Path, ctrl_c_raises
) -> None:
    straight = tmp_path / "straight"
    train(fine_tune_config(base, chat_files), out_dir=straight, progress=False)

    def interrupt(step: int) -> None:
        if step == 6:
            signal.raise_signal(signal.SIGINT)

    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        train(
            fine_tune_config(base, chat_files), out_dir=resumed, progress=False, on_step=interrupt
        )
    assert load_state(resumed / STATE_FILE)["step"] == 6
    summary = train(
        fine_tune_config(base, chat_files), out_dir=resumed, resume=True, progress=False
    )
    assert summary.resumed_from == 6 and summary.step == 12
    a, b = (
        read_weights(straight / "model.safetensors")[0],
        read_weights(resumed / "model.safetensors")[0],
    )
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs bitwise"

    # The run holds the template it was trained with and the grown tokenizer; meta.json the
    # counts; the head metrics have no in-context learning score on conversations.
    assert (straight / TEMPLATE_FILE).read_text() == DEFAULT_TEMPLATE
    run = load_run(straight)
    assert run.tokenizer.vocab_size == load_tokenizer_file(base).vocab_size + 4
    counts = {"conversations": 8, "kept": 8, "truncated": 0, "skipped": 0}
    assert run.meta["chat_data"] == {
        "train": {**counts, "conversations": 32, "kept": 32},
        "val": counts,
    }
    info = run_info(straight)
    assert info["chat"] == {"template": True, "data": run.meta["chat_data"]}
    row = r"chat template +yes \(chat_template\.jinja\); 32 training conversations: 32 kept"
    assert re.search(row, format_info(info))
    evals = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8, 12]
    assert all("induction_max" in r and "icl_score" not in r for r in evals)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]


def test_the_estimate_leaves_out_ignored_targets(base: Path) -> None:
    model = load_run(base).model
    x = torch.randint(0, model.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    y = torch.tensor([[-1, -1, 3, 4, -1, 5], [-1, 7, -1, 8, -1, -1]])

    class Fixed:
        def next(self) -> tuple[torch.Tensor, torch.Tensor]:
            return x, y

    losses = evaluate_loss(
        model,
        {"val": Fixed()},
        2,
        Precision.resolve(torch.device("cpu"), "float32"),
        DistInfo(),
        by_position=True,
    )
    logits, _ = model(x)
    kept = [(b, t) for b in range(2) for t in range(6) if y[b, t] >= 0]
    nll = {k: F.cross_entropy(logits[k[0], k[1]][None], y[k[0], k[1]][None]).item() for k in kept}
    assert losses.mean["val"] == pytest.approx(sum(nll.values()) / len(nll), rel=1e-6)
    by_position = []
    for t in range(6):
        at_t = [nll[(b, t)] for b in range(2) if (b, t) in nll]
        by_position.append(sum(at_t) / len(at_t) if at_t else 0.0)  # positions 0, 4: none
    assert losses.by_position["val"] == pytest.approx(by_position, rel=1e-6)


# --- bad input through the command ----------------------------------------------------------


def cli(capsys, *args: object) -> tuple[int, str]:
    """Run `llmcli` in this process: (exit status, stderr on one line)."""
    from llmcli.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    return exc.value.code, " ".join(capsys.readouterr().err.split())


def test_bad_input_exits_2_naming_what_to_fix_and_writes_no_run(
    base: Path, chat_files: tuple[Path, Path], tmp_path: Path, capsys
) -> None:
    config = tmp_path / "sft.yaml"
    config.write_text(dump_yaml(fine_tune_config(base, chat_files)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(chat_files[0].read_text().splitlines()[0] + '\n{"messages": [{"role": "user"\n')
    template = tmp_path / "t.jinja"
    template.write_text("{% if %}")
    not_a_run = tmp_path / "not-a-run"
    not_a_run.mkdir()
    (not_a_run / "config.yaml").write_text((base / "config.yaml").read_text())
    cases = [
        (f"data.path={bad}", f"{bad} line 2 is not JSON"),
        (f"data.chat_template={template}", "t.jinja) is not a valid Jinja template"),
        (f"train.init_from={not_a_run}", "has no tokenizer.json: it is not a complete llmcli run"),
        (f"train.init_from={tmp_path / 'nowhere'}", "give an llmcli run directory"),
    ]
    out = tmp_path / "out"
    for setting, message in cases:
        code, err = cli(capsys, "train", config, "--set", setting, "--out", out, "--no-progress")
        assert code == 2, err
        assert message in err and "Traceback" not in err
        assert not out.exists()  # nothing written
    # A plain-text run resumed on conversations: its tokenizer has no chat tokens.
    text_run, corpus = tmp_path / "text", tmp_path / "corpus.txt"
    corpus.write_text("Spell cat. And dog?\n" * 100)
    text = fine_tune_config(base, chat_files, max_steps=4)
    text.data = dataclasses.replace(text.data, format="text", path=str(corpus), val_path=None)
    train(text, out_dir=text_run, progress=False)
    code, err = cli(capsys, "train", config, "--out", text_run, "--resume", "--no-progress")
    assert code == 2 and "the run's tokenizer has no chat tokens" in err
    assert load_state(text_run / STATE_FILE)["step"] == 4
    assert not (text_run / TEMPLATE_FILE).exists()
