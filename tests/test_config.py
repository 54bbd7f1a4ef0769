"""Config loading, validation messages and `--set` overrides (llmcli/config/)."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmcli.config import (
    Config,
    ModelConfig,
    SampleConfig,
    config_from_dict,
    describe_shipped,
    dump_yaml,
    load_config,
    shipped_configs,
)
from llmcli.config import shipped as shipped_module
from llmcli.config.loading import apply_overrides, set_options
from llmcli.config.sample import SETTING_KEYS, option_name, setting_info
from llmcli.errors import ConfigError
from llmcli.training.optim import lr_at

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path: Path) -> None:
    config = load_config(path)
    assert config.name == path.stem
    raw = yaml.safe_load(path.read_text())
    # Every value written in the file survives loading unchanged; the corpus path is the same
    # file, made absolute so that the config works from any folder.
    for section, values in raw.items():
        for key, value in values.items():
            loaded = getattr(getattr(config, section), key)
            if (section, key) in (("data", "path"), ("data", "val_path")) and value is not None:
                assert Path(loaded).is_absolute() and Path(loaded).samefile(ROOT / value)
            elif isinstance(value, dict):  # a nested section, such as train.lora
                assert {k: getattr(loaded, k) for k in value} == value, f"{section}.{key}"
            else:
                assert loaded == value, f"{section}.{key}"


def test_tiny_and_small_have_the_issue_sizes() -> None:
    tiny = load_config(ROOT / "configs" / "tiny.yaml").model
    small = load_config(ROOT / "configs" / "small.yaml").model
    assert (tiny.n_layer, tiny.n_head, tiny.n_embed, tiny.context_length) == (4, 4, 128, 64)
    assert (small.n_layer, small.n_head, small.n_embed, small.context_length) == (6, 6, 384, 256)


def test_defaults_fill_every_key_and_round_trip(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "model: {n_layer: 2}\n"))
    assert config.model.n_layer == 2
    assert config.model.n_head == ModelConfig().n_head
    resolved = yaml.safe_load(dump_yaml(config))
    assert list(resolved) == ["model", "data", "train", "sample"]
    assert resolved["model"]["n_layer"] == 2
    # The resolved YAML is itself a valid config that gives back the same values.
    assert config_from_dict(resolved) == config


def test_overrides_are_yaml_scalars_and_validated(tmp_path: Path) -> None:
    path = write(tmp_path, "train: {lr: 0.001}\n")
    config = load_config(
        path,
        [
            "train.max_steps=200",
            "model.n_head=8",
            "train.lr=3e-4",
            "sample.top_k=null",
            "model.bias=false",
            "data.tokenizer=bpe",
        ],
    )
    assert config.train.max_steps == 200
    assert config.model.n_head == 8
    assert config.train.lr == pytest.approx(3e-4)
    assert config.sample.top_k is None
    assert config.model.bias is False
    assert config.data.tokenizer == "bpe"
    divisible = r"n_embed \(128\) must be divisible by model.n_head \(3\)"
    with pytest.raises(ConfigError, match=divisible):
        load_config(path, ["model.n_head=3"])


def test_yaml_11_exponent_without_dot_is_a_number(tmp_path: Path) -> None:
    # PyYAML reads 1e-3 as a string; a config user means a number.
    config = load_config(write(tmp_path, "train:\n  lr: 1e-3\n  min_lr: 1e-5\n"))
    assert config.train.lr == pytest.approx(1e-3)


@pytest.mark.parametrize(
    ("text", "overrides", "pattern"),
    [
        ("model: {n_hed: 4}\n", [], r"unknown key 'model.n_hed'.*Did you mean 'model.n_head'"),
        ("modle: {n_head: 4}\n", [], r"unknown config section 'modle'.*Did you mean 'model'"),
        ("model: {n_layer: four}\n", [], r"model.n_layer must be an integer, got 'four' \(str\)"),
        ("model: {n_layer: 2.5}\n", [], r"model.n_layer must be an integer, got 2.5"),
        ("model: {bias: 1}\n", [], r"model.bias must be true or false"),
        ("train: {lr: fast}\n", [], r"train.lr must be a number"),
        ("model: {pos_emb: alibi}\n", [], r"model.pos_emb must be 'learned' or 'rope'"),
        (
            "model: {n_embed: 100, n_head: 3}\n",
            [],
            r"model.n_embed \(100\) must be divisible by model.n_head \(3\)",
        ),
        ("model: {n_layer: 0}\n", [], r"model.n_layer \(0\) must be positive"),
        ("model: {n_embed: -8}\n", [], r"model.n_embed \(-8\) must be positive"),
        ("model: {context_length: 0}\n", [], r"model.context_length \(0\) must be positive"),
        ("train: {batch_size: 0}\n", [], r"train.batch_size \(0\) must be positive"),
        ("model: {dropout: 1.0}\n", [], r"model.dropout \(1.0\) must be in \[0, 1\)"),
        ("model: {dropout: -0.1}\n", [], r"model.dropout \(-0.1\) must be in \[0, 1\)"),
        (
            "model: {attn_dropout: 1.0}\n",
            [],
            r"model.attn_dropout \(1.0\) must be in \[0, 1\), or null for model.dropout",
        ),
        ("train: {lr: 0}\n", [], r"train.lr \(0.0\) must be > 0"),
        (
            "train: {lr: 0.001, min_lr: 0.01}\n",
            [],
            r"train.min_lr \(0.01\) must be <= train.lr \(0.001\)",
        ),
        ("data: {val_fraction: 0}\n", [], r"data.val_fraction \(0.0\) must be between 0 and 1"),
        ("data: {val_fraction: 1}\n", [], r"data.val_fraction \(1.0\) must be between 0 and 1"),
        ("sample: {top_p: 0}\n", [], r"--top-p / sample.top_p \(0.0\) must be in \(0, 1\]"),
        ("sample: {top_p: 1.5}\n", [], r"--top-p / sample.top_p \(1.5\) must be in \(0, 1\]"),
        (
            "sample: {temperature: -1}\n",
            [],
            r"--temperature / sample.temperature \(-1.0\) must be a number >= 0",
        ),
        ("sample: {top_k: 0}\n", [], r"--top-k / sample.top_k \(0\) must be an integer >= 1"),
        (
            "sample: {context_policy: slide}\n",
            [],
            r"sample.context_policy must be 'exact' or 'shift', got 'slide'",
        ),
        (
            "sample: {context_keep: 0}\n",
            [],
            r"--context-keep / sample.context_keep \(0\) must be in 1..63 ",
        ),
        ("sample: {context_keep: 64}\n", [], r"sample.context_keep \(64\) must be in 1..63 "),
        (
            "model: {context_length: 16}\n",
            ["sample.context_keep=16"],
            r"sample.context_keep \(16\) must be in 1..15 \(1 to model.context_length - 1\)",
        ),
        ("train: {lr: .nan}\n", [], r"train.lr must be a number"),
        ("model: [1, 2]\n", [], r"section 'model' must be a mapping"),
        ("- 1\n- 2\n", [], r"a config must be a mapping"),
        ("data: {path: null}\n", [], r"give either data.path"),
        ("model: {}\n", ["model.n_head"], r"expected section.key=value"),
        ("model: {}\n", ["n_head=4"], r"the key must be section.key"),
        ("model: {}\n", ["modl.n_head=4"], r"unknown section 'modl'.*Did you mean 'model'"),
        ("model: {}\n", ["model.n_head=[1, 2]"], r"must be a single scalar"),
        ("model: {}\n", ["model.n_head=x"], r"model.n_head must be an integer, got 'x'"),
        ("model: {}\n", ["train.lr=-1"], r"train.lr \(-1.0\) must be > 0"),
    ],
)
def test_rule_messages_name_key_value_and_rule(
    tmp_path: Path, text: str, overrides: list[str], pattern: str
) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(write(tmp_path, text), overrides)


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda d: d / "missing.yaml", r"does not exist"),
        (lambda d: d, r"is a directory, not a YAML file"),
        (lambda d: write(d, ""), r"is empty"),
        (lambda d: write(d, "   \n\n"), r"is empty"),
        (lambda d: write(d, "# only a comment\n"), r"holds no settings"),
        (lambda d: write(d, "model: {n_head: 4\n"), r"not valid YAML at line \d+, column \d+"),
        (lambda d: write(d, "model:\n  n_head: 4\n bad: 1\n"), r"not valid YAML"),
    ],
)
def test_unreadable_files_are_config_errors(tmp_path: Path, make, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(make(tmp_path))


def test_a_named_pipe_as_config_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    # In a child with a timeout: reading the pipe would wait forever for a writer.
    fifo = tmp_path / "c.yaml"
    os.mkfifo(fifo)
    out = subprocess.run(
        [sys.executable, "-m", "llmcli", "config", str(fifo)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert f"config file {str(fifo)!r} is a named pipe, not a YAML file" in out.stderr


def test_binary_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "weights.yaml"
    path.write_bytes(b"\x80\x02\x93\xff\x00binary")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(bad byte at offset 0\)"):
        load_config(path)


def test_context_policy_defaults_fill_configs_written_before_it() -> None:
    # A run's config.yaml written before sample.context_policy and sample.context_keep existed.
    old = config_from_dict({"sample": {"max_new_tokens": 100, "temperature": 0.8, "seed": 1}})
    assert (old.sample.context_policy, old.sample.context_keep) == ("shift", None)
    assert config_from_dict({"sample": {"context_keep": 1}}).sample.context_keep == 1
    one_token = {"model": {"context_length": 1}, "sample": {"context_keep": 1}}
    assert config_from_dict(one_token).sample.context_keep == 1  # keeps its one token


def test_sample_config_is_checked_as_it_is_made_and_replaced() -> None:
    # `llmcli sample` applies its options to the run's SampleConfig with dataclasses.replace.
    with pytest.raises(ConfigError, match=r"--top-p / sample.top_p \(0.0\) must be in \(0, 1\]"):
        dataclasses.replace(SampleConfig(), top_p=0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        SampleConfig().top_p = 0.0  # type: ignore[misc]
    # YAML's true is a bool, which Python would take for 1.
    for key, value in (("temperature", True), ("top_p", True), ("seed", True), ("seed", -1)):
        with pytest.raises(ConfigError, match=rf"sample.{key} \({value}\) must be"):
            SampleConfig(**{key: value})
    with pytest.raises(ConfigError, match=r"sample.seed \(1.5\) must be an integer in 0..2\*\*63"):
        SampleConfig(seed=1.5)
    assert SampleConfig(seed=2**63 - 1).seed == 2**63 - 1


# A value each setting's rule refuses. A field added to SampleConfig fails the test below until it
# has one here, and until the server takes it (SAMPLE_FIELDS) or it is named here as the run's.
REFUSED = {
    "max_new_tokens": 0,
    "temperature": -0.5,
    "top_k": 0,
    "top_p": 1.5,
    "seed": -1,
    "context_policy": "slide",
    "context_keep": 1.5,
    "ignore_eos": "yes",
}
NOT_REQUEST_FIELDS = {"context_policy", "context_keep", "ignore_eos"}  # the run's config sets them


def test_every_sample_setting_makes_its_option_and_request_field_with_its_help_and_rule(
    capsys,
) -> None:
    from typer.main import get_command

    from llmcli.cli import app, main
    from llmcli.serve.request import SAMPLE_FIELDS, Limits, parse_completion
    from llmcli.serve.response import APIError

    assert set(REFUSED) == set(SETTING_KEYS)
    request_field = {key: name for name, key in SAMPLE_FIELDS.items()}
    assert set(request_field) == set(SETTING_KEYS) - NOT_REQUEST_FIELDS
    sample = get_command(app).commands["sample"]
    options = {opt: param for param in sample.params for opt in param.opts}
    with pytest.raises(SystemExit):
        main(["sample", "--help"])
    shown = capsys.readouterr().out
    for key, bad in REFUSED.items():
        info = setting_info(key)
        option = options[option_name(key)]  # llmcli sample's option, with the field's help
        assert info["help"].removesuffix(".") in option.help and option_name(key) in shown
        assert option.default is None  # not given: the run's value
        with pytest.raises(ConfigError) as exc:
            SampleConfig(**{key: bad})
        assert str(exc.value) == f"{option_name(key)} / sample.{key} ({bad!r}) {info['rule']}."
        name = request_field.get(key, key)
        with pytest.raises(APIError) as refused:
            parse_completion({"prompt": "a", name: bad}, SampleConfig(), Limits(), "tiny")
        error = refused.value
        if key in NOT_REQUEST_FIELDS:
            assert (error.status, error.code) == (400, "unknown_parameter")
        else:  # the server's message names its field and SampleConfig's rule
            assert (error.status, error.param, error.code) == (400, name, "invalid_value")
            assert error.message == f"{name} ({bad!r}) {info['rule']}."


def test_config_error_is_a_value_error() -> None:
    # Library users can catch ValueError, as with litgpt's configs.
    with pytest.raises(ValueError):
        config_from_dict({"model": {"n_head": 5}})


def test_default_config_is_valid_and_is_what_an_empty_file_gives() -> None:
    config = Config()
    config.validate()
    # A file with only empty sections resolves to the same defaults, and validating is not a
    # no-op: one default broken, the same config is refused.
    assert config_from_dict({"model": None, "train": {}}) == config
    broken = dataclasses.replace(config, train=dataclasses.replace(config.train, lr=0.0))
    with pytest.raises(ConfigError, match=r"train\.lr \(0\.0\) must be > 0"):
        broken.validate()
    # GPT-2's architecture by default (ModelConfig's docstring), with whole heads.
    model = config.model
    assert (model.pos_emb, model.norm, model.mlp, model.bias, model.tie_embeddings) == (
        "learned",
        "layernorm",
        "gelu",
        True,
        True,
    )
    assert model.head_size * model.n_head == model.n_embed


# --- shipped configs by name ---------------------------------------------------------------


def test_shipped_names_load_from_any_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # an empty folder: no configs/, no data/
    assert set(shipped_configs()) == {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    for name in shipped_configs():
        config = load_config(name, ["train.max_steps=7"])
        assert config.name == name and config.train.max_steps == 7
        # the bundled corpus, found from here (or a Hub dataset: tinystories)
        assert Path(config.data.path).is_file() if config.data.path else config.data.dataset
    assert (
        load_config("tiny.yaml").to_dict() == load_config(ROOT / "configs" / "tiny.yaml").to_dict()
    )
    assert Path(load_config("speedrun-cpu").data.path).samefile(
        ROOT / "data" / "tinyshakespeare.txt"
    )


def test_relative_paths_of_users_configs_and_overrides_stay_relative(tmp_path: Path) -> None:
    own = write(tmp_path, "data: {path: data/shakespeare.txt}\n", name="tiny.yaml")
    assert load_config(own).data.path == "data/shakespeare.txt"  # a user's file, not shipped
    assert load_config("tiny", ["data.path=data/mine.txt"]).data.path == "data/mine.txt"


def test_unknown_name_lists_the_shipped_names(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"'tinny' does not exist.*small, .*tiny"):
        load_config("tinny")


def test_a_missing_bundled_corpus_names_the_file(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.yaml").write_text((ROOT / "configs" / "tiny.yaml").read_text())
    (tmp_path / "data").mkdir()  # a broken install: the corpus is gone
    monkeypatch.setattr(shipped_module, "_PACKAGE_DIR", tmp_path / "llmcli")
    with pytest.raises(ConfigError, match=r"bundled corpus '.*shakespeare.txt', which is missing"):
        load_config("tiny")


def test_list_describes_every_shipped_config_by_its_first_sentence() -> None:
    rows = dict(describe_shipped())
    assert set(rows) == set(shipped_configs())
    for name, line in rows.items():
        comment = (ROOT / "configs" / f"{name}.yaml").read_text().split("\n#\n")[0]
        joined = " ".join(part.lstrip("#").strip() for part in comment.splitlines())
        assert joined.startswith(line) and line.endswith(".") and 20 < len(line) <= 240, line
    # A sentence that runs over two comment lines is given whole.
    assert rows["speedrun-cpu-600s"].endswith(
        "at most 1.50 (`llmcli train speedrun-cpu-600s`, start to exit)."
    )


# --- short runs ------------------------------------------------------------------------------


def test_a_warmup_longer_than_the_run_is_cut_to_it_with_a_note() -> None:
    config = load_config("tiny", ["train.max_steps=20"])  # warmup_steps 100, eval_interval 250
    train = config.train
    assert train.warmup == 20 and train.warmup_steps == 100
    notes = train.short_run_notes()
    assert len(notes) == 2 and "warmup_steps (100)" in notes[0] and "eval_interval" in notes[1]
    rates = [lr_at(s, train) for s in range(20)]
    assert rates == pytest.approx([train.lr * (s + 1) / 21 for s in range(20)])
    assert load_config("tiny").train.short_run_notes() == []


# --- DPO: train.objective and data.format preference ---------------------------------------

DPO = {
    "data": {"path": "prefs.jsonl", "format": "preference"},
    "train": {"objective": "dpo", "init_from": "checkpoints/chat"},
}


def test_dpo_reads_preference_pairs_from_a_run_with_beta_by_default() -> None:
    config = config_from_dict(DPO)
    assert (config.train.objective, config.train.dpo_beta) == ("dpo", 0.1)
    assert Config().train.objective == "next_token"
    assert (config.train.loss_type, config.train.loss_types) == (None, [])  # DPO's: sigmoid


def test_loss_types_are_a_name_a_list_or_names_with_commas_with_a_weight_each() -> None:
    for given in ("sigmoid, sft", ["sigmoid", "sft"]):
        train = {**DPO["train"], "loss_type": given, "loss_weights": "1.0, 0.5"}
        config = config_from_dict({**DPO, "train": train})
        assert config.train.loss_types == ["sigmoid", "sft"]
        assert config.train.loss_weight_values == [1.0, 0.5]
    train = {**DPO["train"], "loss_type": "robust", "label_smoothing": 0.1}
    assert config_from_dict({**DPO, "train": train}).train.label_smoothing == 0.1


@pytest.mark.parametrize("train", [{"loss_weights": [1.0]}, {"label_smoothing": 0.1}])
def test_dpo_loss_settings_of_another_objective_are_refused_naming_dpo(train: dict) -> None:
    (key,) = train
    with pytest.raises(ConfigError, match=rf"train.{key} .* applies to train.objective: dpo"):
        config_from_dict({"train": train})
    with pytest.raises(ConfigError, match="train.objective is 'next_token': remove train.loss_"):
        config_from_dict({"train": {"loss_type": "sigmoid"}})


@pytest.mark.parametrize(
    ("data", "train", "pattern"),
    [
        ({}, {"init_from": None}, r"train.objective \('dpo'\) .*set train.init_from"),
        ({"format": "chat"}, {}, r"data.format is 'chat'.*set data.format: preference"),
        ({}, {"objective": "next_token"}, r"only DPO reads.*set train.objective: dpo"),
        ({}, {"dpo_beta": 0.0}, r"train.dpo_beta \(0.0\) must be > 0"),
        ({}, {"objective": "ppo"}, r"train.objective must be 'next_token' or 'dpo'"),
        ({"format": "pairs"}, {}, r"data.format \('pairs'\) must be .*'preference'"),
        (
            {},
            {"loss_type": "sigmod"},
            r"\('sigmod'\) is not one of dpo's: sigmoid, hinge, .*"
            r"Did you mean 'sigmoid'",
        ),
        ({}, {"loss_type": ["ipo", "sft_"]}, r"\('sft_'\) is not one of .*Did you mean 'sft'"),
        ({}, {"loss_type": []}, r"train.loss_type \(\[\]\) must name a loss type"),
        (
            {},
            {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]},
            r"loss_weights \(\[1.0\]\) has 1 weight\(s\) for 2 loss type\(s\) \(sigmoid, sft\)",
        ),
        ({}, {"loss_weights": "1,2"}, r"has 2 weight\(s\) for 1 loss type\(s\) \(sigmoid\)"),
        ({}, {"loss_weights": "1,x"}, r"train.loss_weights \('1,x'\) must be numbers"),
        ({}, {"label_smoothing": 0.1}, r"label_smoothing \(0.1\) changes nothing with .*sigmoid"),
        (
            {},
            {"loss_type": "robust", "label_smoothing": 0.5},
            r"label_smoothing \(0.5\) must be below 0.5 with the robust loss",
        ),
        ({}, {"loss_type": "exo_pair"}, r"must be > 0 with the exo_pair loss"),
    ],
)
def test_dpo_config_errors_name_the_fix(data: dict, train: dict, pattern: str) -> None:
    raw = {"data": {**DPO["data"], **data}, "train": {**DPO["train"], **train}}
    with pytest.raises(ConfigError, match=pattern):
        config_from_dict(raw)


def test_set_options_give_back_the_values_they_write_through_a_shell() -> None:
    """What a resume tells the user to pass (`describe_changes`): lists, mappings and scalars,
    as a shell splits them, read back by `--set` to the same values."""
    values = {
        "train.reward": ["exact", "number"],
        "train.reward_weights": [1.0, 0.5],
        "train.lora": {"rank": 8, "alpha": 8.0},
        "train.lr": 0.0003,
        "train.init_from": "runs/my chat",
    }
    args = [arg for key, value in values.items() for arg in set_options(key, value)]
    overrides = shlex.split(" ".join(args))[1::2]  # the texts after each --set
    raw = apply_overrides({"train": {"objective": "grpo"}}, overrides)
    for key, value in values.items():
        section, name = key.split(".")
        got = raw[section][name]
        if name == "lora":
            assert {k: got[k] for k in value} == value
        elif isinstance(value, list):
            assert [x.strip() for x in str(got).split(",")] == [str(v) for v in value]
        else:
            assert got == value
