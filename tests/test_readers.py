"""Every file llmcli reads is checked by its reader before it is used: a damaged or hostile field
is exit status 2 with a message naming the file and the field, never a traceback; in a file that
is informative only (`meta.json`, `metrics.jsonl`) what is right is still shown.

One test per class of failure that was found by trying damaged inputs as a user would: a run's
`meta.json`, a Hugging Face `config.json` and `pytorch_model.bin`, tokenizer files (a model that
fails while encoding, llmcli's old char format), a tracker package that is installed but does
not import, a `state.pt` that loads but does not fit, a folder named like a shipped config,
absurd metric values, and `LLMCLI_DIST_JOIN_TIMEOUT`. `test_fuzz_readers.py` draws random values
for every field of each file.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_run, small_run_config
from hf_helpers import TEXT as HF_TEXT
from hf_helpers import make_run
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from llmcli.cli import main
from llmcli.config import config_from_dict
from llmcli.config.shipped import find_config, shipped_configs
from llmcli.data.tokenizer import CharTokenizer, load_tokenizer
from llmcli.errors import InputError
from llmcli.hf.export import export_hf
from llmcli.runs.directory import METRICS_FILE, STATE_FILE
from llmcli.training.loop import train

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me!\n"
MODEL = {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 16}


def cli(capsys, *args) -> tuple[int, str, str]:
    """Run `llmcli` in-process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return exc.value.code, out.out, " ".join(out.err.split())


def fake_run(run_dir: Path, meta: dict, records: list[dict]) -> Path:
    """A readable run with the given extra `meta.json` fields and `metrics.jsonl` records."""
    save_tiny_run(run_dir, CharTokenizer.train([TEXT]), {"model": MODEL}, extra_meta=meta)
    lines = [json.dumps(r) for r in records]
    (run_dir / METRICS_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return run_dir


RECORDS = [
    {"kind": "train", "step": 1, "tokens": 64, "elapsed_s": 0.5, "train_loss": 4.0, "lr": 1e-3},
    {
        "kind": "eval",
        "step": 2,
        "tokens": 128,
        "elapsed_s": 2.0,
        "train_loss": 3.6,
        "val_loss": 3.5,
    },
]


# --- 1. meta.json is informative: what is right is shown --------------------------------------


def test_a_meta_json_field_of_the_wrong_type_is_left_out_and_the_rest_shown(
    tmp_path, capsys, caplog
) -> None:
    bad = {"tokens": "many", "elapsed_s": [1], "best_val_loss": "low", "versions": "x", "step": -3}
    fake_run(tmp_path / "a", bad, RECORDS)
    fake_run(tmp_path / "b", {"tokens": 256, "elapsed_s": 4.0, "step": 2}, RECORDS)
    code, out, err = cli(capsys, "compare", tmp_path / "a", tmp_path / "b", "--json")
    assert code == 0, err
    rows = {Path(r["run"]).name: r for r in json.loads(out)["runs"]}
    # a's own figures are left out, so the last metrics record's are shown
    assert (rows["a"]["tokens"], rows["a"]["elapsed_s"], rows["a"]["steps"]) == (128, 2.0, 2)
    assert rows["a"]["tokens_per_s"] == 128 / 2.0 and rows["a"]["best_val_loss"] == 3.5
    assert (rows["b"]["tokens"], rows["b"]["elapsed_s"], rows["b"]["tokens_per_s"]) == (
        256,
        4.0,
        64,
    )
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "meta.json: left out" in warned and "tokens ('many')" in warned

    code, out, err = cli(capsys, "info", "--checkpoint", tmp_path / "a", "--json")
    assert code == 0, err
    training = json.loads(out)["training"]
    assert (training["tokens"], training["best_val_loss"], training["best_step"]) == (None, 3.5, 2)


# --- 2. a Hugging Face config.json: every field it uses is typed --------------------------------


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """A tiny run exported in each Hugging Face architecture."""
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for fmt, opts in (
        ("gpt2", {}),
        ("gpt-neox", {"pos_emb": "rope"}),
        ("arcee", {"pos_emb": "rope", "norm": "rmsnorm"}),
    ):
        run = make_run(root / f"run-{fmt}", "char", **opts)
        export_hf(run, root / fmt, fmt=fmt)
        out[fmt] = root / fmt
    return out


def edited_copy(folder: Path, to: Path, change: dict) -> Path:
    shutil.copytree(folder, to)
    cfg = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**cfg, **change}))
    return to


@pytest.mark.parametrize(
    ("fmt", "change", "named"),
    [
        ("gpt2", {"model_type": ["gpt2"]}, "model_type"),
        ("gpt2", {"activation_function": ["gelu"]}, "activation_function"),
        ("gpt2", {"tie_word_embeddings": "no"}, "tie_word_embeddings"),
        ("gpt2", {"n_inner": "128"}, "n_inner"),
        ("gpt2", {"vocab_size": 83.0}, "vocab_size"),
        ("gpt2", {"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon"),
        ("gpt-neox", {"hidden_act": ["gelu"]}, "hidden_act"),
        ("gpt-neox", {"use_parallel_residual": "false"}, "use_parallel_residual"),
        ("arcee", {"rope_theta": "10000"}, "rope_theta"),
        ("arcee", {"rope_parameters": [10000]}, "rope_parameters"),
        ("arcee", {"rope_parameters": {"rope_theta": "big"}}, "rope_theta"),
        ("arcee", {"rope_parameters": {"rope_theta": -1.0}}, "rope_theta"),
        ("arcee", {"num_key_value_heads": [4]}, "num_key_value_heads"),
    ],
)
def test_init_from_a_config_json_field_of_the_wrong_type_exits_2_naming_it(
    exports, tmp_path, capsys, fmt, change, named
) -> None:
    folder = edited_copy(exports[fmt], tmp_path / "hf", change)
    config = tmp_path / "c.yaml"
    config.write_text("train: {device: cpu, max_steps: 2, warmup_steps: 0}\n")
    code, _, err = cli(
        capsys, "train", config, "--out", tmp_path / "run", "--set", f"train.init_from={folder}"
    )
    assert code == 2 and "Traceback" not in err
    assert str(folder / "config.json") in err and named in err, err
    assert not (tmp_path / "run").exists()


class Marker:
    """Unpickling this would create a folder: proof that code ran while loading."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_a_pickled_pytorch_model_bin_is_refused_unread_saying_so(exports, tmp_path, capsys):
    folder = edited_copy(exports["gpt2"], tmp_path / "hf", {})
    (folder / "model.safetensors").unlink()
    ran = tmp_path / "code-ran"
    torch.save({"transformer.wte.weight": Marker(str(ran))}, folder / "pytorch_model.bin")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(HF_TEXT * 5)
    config = tmp_path / "c.yaml"
    config.write_text(
        f"data: {{path: {corpus}}}\ntrain: {{device: cpu, max_steps: 2, warmup_steps: 0}}\n"
    )
    code, _, err = cli(
        capsys, "train", config, "--out", tmp_path / "run", "--set", f"train.init_from={folder}"
    )
    assert code == 2 and not ran.exists()
    assert f"weights file '{folder / 'pytorch_model.bin'}' holds Python objects" in err
    assert "refused unread" in err and "Convert it to model.safetensors" in err


# --- 3 and 4. tokenizer files ----------------------------------------------------------------


def test_a_tokenizer_whose_model_fails_while_encoding_is_bad_input_in_a_batch_too(
    tmp_path, capsys
) -> None:
    # A WordLevel model whose unknown token is not in its vocabulary fails on an unknown word.
    hf = HFTokenizer(models.WordLevel(vocab={"to": 0, "be": 1}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    tok = load_tokenizer(path)
    assert tok.encode("to be") == [0, 1] and tok.encode_batch(["to be", "be"]) == [[0, 1], [1]]
    with pytest.raises(InputError, match="cannot encode this text") as single:
        tok.encode("to be or not")
    with pytest.raises(InputError, match="cannot encode this text") as batch:
        tok.encode_batch(["to be", "to be or not"])
    assert str(batch.value) == str(single.value)

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be\n" * 50)
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"data": {"path": str(corpus), "tokenizer": str(path)}}))
    code, _, err = cli(capsys, "prepare-data", config, "--set", f"data.cache_dir={tmp_path}/c")
    assert code == 2 and "cannot encode this text" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"version": "2"}, "'version' ('2')"),
        ({"version": 3}, "'version' (3)"),
        ({"version": True}, "'version' (True)"),
        ({"chars": "abc"}, "'chars'"),
        ({"chars": ["ab", "c"]}, "'chars'"),
        ({"chars": []}, "'chars'"),
        ({"eot": 5}, "'eot'"),
        ({"eot": ["<|endoftext|>"]}, "'eot'"),
    ],
)
def test_an_old_format_char_tokenizer_field_of_the_wrong_type_exits_2(
    tmp_path, capsys, change, named
) -> None:
    chars = sorted(set(TEXT))
    old = {"kind": "llmcli-char", "version": 2, "chars": chars, "eot": "<|endoftext|>", **change}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 20)
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"data": {"path": str(corpus), "tokenizer": str(path)}}))
    code, _, err = cli(capsys, "prepare-data", config, "--set", f"data.cache_dir={tmp_path}/c")
    assert code == 2 and "Traceback" not in err
    assert str(path) in err and named in err, err
    # the same file as a run's tokenizer.json
    run = save_tiny_run(tmp_path / "run", CharTokenizer(chars), {"model": MODEL})
    shutil.copy(path, run / "tokenizer.json")
    code, _, err = cli(capsys, "sample", "--checkpoint", run, "--prompt", "RO")
    assert code == 2 and str(run / "tokenizer.json") in err and named in err, err


def test_an_old_format_char_tokenizer_still_loads_in_both_versions(tmp_path) -> None:
    chars = sorted(set(TEXT))
    for version, extra, size in (
        (1, {}, len(chars)),
        (2, {"eot": "<|endoftext|>"}, len(chars) + 1),
    ):
        path = tmp_path / f"v{version}.json"
        old = {"kind": "llmcli-char", "version": version, "chars": chars, **extra}
        path.write_text(json.dumps(old))
        tok = load_tokenizer(path)
        assert tok.vocab_size == size and tok.encode("RO") == [chars.index("R"), chars.index("O")]


# --- 5. a tracker package that is installed but does not import ------------------------------


def test_an_installed_tracker_that_fails_to_import_exits_2_before_anything_is_written(
    small_corpus, tmp_path, monkeypatch, capsys
) -> None:
    fake = tmp_path / "site"
    (fake / "tensorboard").mkdir(parents=True)
    (fake / "tensorboard" / "__init__.py").write_text("raise ImportError('a broken install')\n")
    monkeypatch.syspath_prepend(str(fake))
    for name in [
        m for m in sys.modules if m.startswith(("tensorboard", "torch.utils.tensorboard"))
    ]:
        monkeypatch.delitem(sys.modules, name)
    config = tmp_path / "c.json"
    config.write_text(json.dumps(small_run_config(small_corpus, max_steps=2, eval_interval=2)))
    run = tmp_path / "run"
    code, _, err = cli(
        capsys, "train", config, "--out", run, "--set", "train.logger=tensorboard", "--no-progress"
    )
    assert code == 2 and "Traceback" not in err
    assert "the tensorboard package is installed but `import torch.utils.tensorboard` fails" in err
    assert "a broken install" in err
    assert not run.exists()  # nothing written: no config.yaml, no tokenizer.json


# --- 6. a state.pt that loads but does not fit -------------------------------------------------


@pytest.fixture(scope="module")
def saved_run(small_corpus) -> tuple[Path, Path]:
    """A run trained 4 steps with a save, and its config file."""
    root = small_corpus.parent / "saved"
    root.mkdir()
    config = root / "c.json"
    config.write_text(json.dumps(small_run_config(small_corpus, max_steps=4, eval_interval=4)))
    train(config_from_dict(json.loads(config.read_text())), out_dir=root / "run", progress=False)
    return root / "run", config


def numpy_state_as_a_dict(state: dict) -> None:
    name, keys, pos, has_gauss, cached = state["rng"][0]["numpy"]
    state["rng"][0]["numpy"] = {"name": name, "keys": keys, "pos": pos}


def python_state_cut(state: dict) -> None:
    version, internal, gauss = state["rng"][0]["python"]
    state["rng"][0]["python"] = (version, internal[:10], gauss)


def numpy_key_as_floats(state: dict) -> None:
    name, keys, pos, has_gauss, cached = state["rng"][0]["numpy"]
    state["rng"][0]["numpy"] = (name, keys.double(), pos, has_gauss, cached)


def train_section_a_list(state: dict) -> None:
    state["config"]["train"] = list(state["config"]["train"].items())


def sample_section_a_string(state: dict) -> None:
    state["config"]["sample"] = "defaults"


def a_weight_missing(state: dict) -> None:
    del state["model"]["blocks.0.mlp.fc.weight"]


def an_unexpected_weight(state: dict) -> None:
    state["model"]["blocks.7.mlp.fc.weight"] = state["model"]["blocks.0.mlp.fc.weight"]


def a_weight_of_integers(state: dict) -> None:
    state["model"]["ln_f.weight"] = state["model"]["ln_f.weight"].long()


def a_moment_of_the_wrong_shape(state: dict) -> None:
    entry = state["optimizer"]["state"][0]
    entry["exp_avg"] = entry["exp_avg"][:1]


def a_moment_missing(state: dict) -> None:
    del state["optimizer"]["state"][0]["exp_avg_sq"]


def a_parameter_id_unknown(state: dict) -> None:
    state["optimizer"]["state"][999] = state["optimizer"]["state"][0]


def the_sampler_count_a_string(state: dict) -> None:
    state["sampler"][0]["batches"] = "ten"


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (numpy_state_as_a_dict, "rng"),
        (python_state_cut, "rng"),
        (numpy_key_as_floats, "rng"),
        (train_section_a_list, "config"),
        (sample_section_a_string, "config"),
        (a_weight_missing, "lacks tensors blocks.0.mlp.fc.weight"),
        (an_unexpected_weight, "has tensors the model does not: blocks.7.mlp.fc.weight"),
        (a_weight_of_integers, "'ln_f.weight' is a Tensor of torch.int64"),
        (a_moment_of_the_wrong_shape, "optimizer state does not fit"),
        (a_moment_missing, "optimizer state does not fit"),
        (a_parameter_id_unknown, "the state of parameter 999"),
        (the_sampler_count_a_string, "sampler"),
    ],
)
def test_a_state_pt_that_does_not_fit_is_refused_before_anything_is_touched(
    saved_run, tmp_path, capsys, damage, named
) -> None:
    original, config = saved_run
    run = tmp_path / "run"
    shutil.copytree(original, run)
    state = torch.load(run / STATE_FILE, weights_only=True)
    damage(state)
    torch.save(state, run / STATE_FILE)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    code, _, err = cli(
        capsys, "train", config, "--out", run, "--resume", "auto", "--set", "train.max_steps=6"
    )
    assert code == 2 and "Traceback" not in err
    assert str(run / STATE_FILE) in err and named in err, err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


# --- 7. a shipped config name wins over a folder ---------------------------------------------


def test_a_folder_named_like_a_shipped_config_does_not_hide_it(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()  # what `llmcli train tiny --out tiny` leaves
    assert find_config("tiny") == (shipped_configs()["tiny"], True)
    (tmp_path / "tiny.yaml").mkdir()
    assert find_config("tiny.yaml") == (shipped_configs()["tiny"], True)
    (tmp_path / "small").write_text("model: {n_layer: 1}\n")  # a file still shadows the name
    assert find_config("small") == (Path("small"), False)


def test_the_documented_restart_command_finds_the_shipped_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    code, out, err = cli(capsys, "config", "tiny")
    assert code == 0 and "n_layer: 4" in out, err


# --- 8. absurd metric values, and the join timeout in a 1-process run --------------------------


def test_compare_draws_absurd_metric_values_without_a_warning(tmp_path, capsys, caplog) -> None:
    huge = [
        {"kind": "eval", "step": s, "tokens": 64 * s, "elapsed_s": 1.0 * s, "val_loss": v}
        for s, v in ((1, 1e308), (2, -1e308), (3, 5e-324), (4, 1.7e308))
    ]
    fake_run(tmp_path / "a", {}, huge)
    fake_run(tmp_path / "b", {}, RECORDS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        code, out, err = cli(
            capsys, "compare", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "c.png"
        )
    assert code == 0, err
    assert (tmp_path / "c.png").read_bytes().startswith(b"\x89PNG")
    best = min(r["val_loss"] for r in huge)
    assert f"{best:.4f}" in out  # the table shows the value as it is
    left_out = [r for r in huge if abs(r["val_loss"]) > 1e300]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert f"{len(left_out)} point(s) of val_loss beyond +-1e+300 are left out" in warned


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan"])
def test_a_bad_join_timeout_is_refused_in_a_1_process_run(
    small_corpus, tmp_path, monkeypatch, capsys, value
) -> None:
    monkeypatch.setenv("LLMCLI_DIST_JOIN_TIMEOUT", value)
    config = tmp_path / "c.json"
    config.write_text(json.dumps(small_run_config(small_corpus, max_steps=2, eval_interval=2)))
    code, _, err = cli(capsys, "train", config, "--out", tmp_path / "run", "--no-progress")
    assert code == 2 and f"LLMCLI_DIST_JOIN_TIMEOUT={value!r}" in err, err
    assert not (tmp_path / "run").exists()
