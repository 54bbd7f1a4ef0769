"""Every bad input gets exit status 2, a message naming the problem, and no traceback.

One table of bad inputs across `config`, `train`, `sample`, `inspect-attention`, `eval` and
`export`:
missing, empty, binary and directory-instead-of-file configs and corpora, malformed YAML, wrong
types, out-of-range values, unknown keys, hostile YAML (alias bombs, deep nesting), prompts
outside the vocabulary or too long, missing, truncated, pickled or mismatched run files, and
unwritable outputs. Each case runs in-process through `llmcli.cli.main` (the same code path as
the console script, minus the interpreter start); one case also runs as a real process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from conftest import save_tiny_run

from llmcli.cli import main
from llmcli.config import config_from_dict
from llmcli.data.tokenizer import CharTokenizer
from llmcli.runs.formats import WEIGHTS_FORMAT
from llmcli.training.loop import train

ROOT = Path(__file__).resolve().parents[1]
TEXT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me!\n"
MODEL = {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 16}
TRAIN = {
    "device": "cpu",
    "batch_size": 4,
    "max_steps": 4,
    "warmup_steps": 1,
    "eval_interval": 4,
    "eval_steps": 1,
    "log_interval": 2,
    "seed": 5,
}


class Marker:
    """Unpickling this would create a folder: proof that code ran while loading."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict[str, Path]:
    """A corpus, a readable run (no resume state) and a trained run (with `state.pt`)."""
    root = tmp_path_factory.mktemp("robust")
    corpus = root / "corpus.txt"
    corpus.write_text(
        (ROOT / "data" / "shakespeare.txt").read_text(encoding="utf-8")[:4000], encoding="utf-8"
    )
    save_tiny_run(root / "run", CharTokenizer.train([TEXT]), {"model": MODEL})
    trained = root / "trained"
    train(config_from_dict(train_dict(corpus, root / "cache")), out_dir=trained, progress=False)
    return {
        "root": root,
        "corpus": corpus,
        "run": root / "run",
        "trained": trained,
        "cache": root / "cache",
    }


def train_dict(corpus: Path, cache: Path, **sections: dict) -> dict:
    raw = {
        "model": dict(MODEL),
        "data": {"path": str(corpus), "cache_dir": str(cache)},
        "train": dict(TRAIN),
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


@dataclass
class Env:
    """What a case builds its inputs from: `tmp` is fresh for every case."""

    tmp: Path
    shared: dict[str, Path]

    def __post_init__(self) -> None:
        self.file("f.txt", "a file where a folder is expected")

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        return path

    def config(self, **sections: dict) -> str:
        """A valid tiny training config (with `sections` merged in), as a path."""
        raw = train_dict(self.shared["corpus"], self.shared["cache"], **sections)
        return str(self.file("c.yaml", yaml.safe_dump(raw)))

    def copy(self, which: str = "run") -> Path:
        target = self.tmp / which
        shutil.copytree(self.shared[which], target)
        return target

    @property
    def marker(self) -> Path:
        return self.tmp / "code-ran"


Argv = Callable[[Env], list[str]]


def c(text: str | bytes, *extra: str) -> Argv:
    """`llmcli config FILE` on a file holding `text`."""
    return lambda e: ["config", str(e.file("c.yaml", text)), *extra]


def s(*overrides: str) -> Argv:
    """`llmcli config` on a valid file with `--set` overrides."""
    return lambda e: ["config", e.config(), *[a for o in overrides for a in ("--set", o)]]


def t(*args: str, **sections: dict) -> Argv:
    """`llmcli train` on the tiny config (sections merged) with `args`."""
    return lambda e: [
        "train",
        e.config(**sections),
        "--out",
        str(e.tmp / "out"),
        "--no-progress",
        *args,
    ]


def corpus_case(content: str | bytes | None, name: str = "corpus.txt") -> Argv:
    def argv(e: Env) -> list[str]:
        path = e.tmp / name
        if content is None:
            path.mkdir()
        else:
            e.file(name, content)
        return t(data={"path": str(path)})(e)

    return argv


def resume(mutate: Callable[[Env, Path], None], **sections: dict) -> Argv:
    """`train --resume` on a copy of the trained run after `mutate(env, run_dir)`."""

    def argv(e: Env) -> list[str]:
        run = e.copy("trained")
        mutate(e, run)
        return ["train", e.config(**sections), "--out", str(run), "--resume", "--no-progress"]

    return argv


def on_run(
    command: str, mutate: Callable[[Env, Path], None] | None, *args: str, which: str = "run"
) -> Argv:
    """`llmcli COMMAND --checkpoint RUN args` on a copy of a run after `mutate(env, run)`."""

    def argv(e: Env) -> list[str]:
        run = e.copy(which)
        if mutate is not None:
            mutate(e, run)
        return [command, "--checkpoint", str(run), *[a.replace("{tmp}", str(e.tmp)) for a in args]]

    return argv


def truncate(name: str, fraction: float = 0.5) -> Callable[[Env, Path], None]:
    def mutate(e: Env, run: Path) -> None:
        data = (run / name).read_bytes()
        (run / name).write_bytes(data[: int(len(data) * fraction)])

    return mutate


def pickle_as(name: str) -> Callable[[Env, Path], None]:
    def mutate(e: Env, run: Path) -> None:
        obj = {"format": WEIGHTS_FORMAT, "w": Marker(str(e.marker))}
        torch.save(obj, run / name)

    return mutate


def remove(*names: str) -> Callable[[Env, Path], None]:
    def mutate(e: Env, run: Path) -> None:
        for name in names:
            (run / name).unlink()

    return mutate


def write(name: str, content: str | bytes) -> Callable[[Env, Path], None]:
    def mutate(e: Env, run: Path) -> None:
        path = run / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)

    return mutate


def other_tokenizer(e: Env, run: Path) -> None:
    CharTokenizer.train([TEXT + "XYZ#"]).save(run / "tokenizer.json")


def bigger_tokenizer(e: Env, run: Path) -> None:
    corpus = e.shared["corpus"].read_text(encoding="utf-8")
    CharTokenizer.train([corpus + "¤"]).save(run / "tokenizer.json")


def wider_config(e: Env, run: Path) -> None:
    raw = yaml.safe_load((run / "config.yaml").read_text())
    raw["model"]["n_embed"] = 32
    (run / "config.yaml").write_text(yaml.safe_dump(raw))


def malformed_state(e: Env, run: Path) -> None:
    state = torch.load(run / "state.pt", weights_only=True)
    state["rng"] = "not a list of RNG states"
    torch.save(state, run / "state.pt")


def alias_bomb() -> str:
    # "Billion laughs": nine levels of ten aliases; its repr would be 10**9 strings long.
    items = ['&a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    return "model:\n  n_layer: [" + ", ".join(items) + "]\n"


TOO_LONG = "ROMEO: But soft, what light"  # 27 characters for a context of 16

CASES = [
    # --- config: the file itself ----------------------------------------------------------
    pytest.param(
        lambda e: ["config", str(e.tmp / "none.yaml")],
        r"none\.yaml' does not exist",
        id="config-missing",
    ),
    pytest.param(c(""), "is empty", id="config-empty"),
    pytest.param(c("# only a comment\n"), "holds no settings", id="config-comments-only"),
    pytest.param(
        c(bytes(range(256))), r"not UTF-8 text \(bad byte at offset 128\)", id="config-binary"
    ),
    pytest.param(
        lambda e: ["config", str(e.tmp)], "is a directory, not a YAML file", id="config-directory"
    ),
    pytest.param(c("model: [1, 2\n"), r"not valid YAML at line 2", id="config-unclosed-bracket"),
    pytest.param(c("model:\n\tn_layer: 2\n"), r"not valid YAML at line 2", id="config-tab-indent"),
    pytest.param(c("- model\n- train\n"), r"must be a mapping .* got list", id="config-list"),
    pytest.param(c("42\n"), r"must be a mapping .* got int", id="config-scalar"),
    pytest.param(
        c("model: {n_layer: 1}\nmodle: {}\n"),
        r"section 'modle'\. Did you mean 'model'",
        id="config-unknown-section",
    ),
    pytest.param(
        c("model: {n_layers: 2}\n"),
        r"'model\.n_layers'\. Did you mean 'model\.n_layer'",
        id="config-unknown-key",
    ),
    pytest.param(c("train: 5\n"), r"section 'train' must be a mapping", id="config-section-int"),
    pytest.param(
        c(alias_bomb()), r"model\.n_layer must be an integer, got \[\['lol'", id="config-alias-bomb"
    ),
    pytest.param(
        c("model: " + "[" * 600 + "]" * 600 + "\n"),
        "nests lists or mappings too deep",
        id="config-deep-nesting",
    ),
    pytest.param(
        c("model: {n_layer: !!python/object/apply:os.getcwd []}\n"),
        "not valid YAML",
        id="config-python-tag",
    ),
    # --- config: values ---------------------------------------------------------------------
    pytest.param(
        c("model: {n_layer: four}\n"),
        r"model\.n_layer must be an integer, got 'four'",
        id="value-str-for-int",
    ),
    pytest.param(
        c("train: {max_steps: yes}\n"),
        r"train\.max_steps must be an integer, got True",
        id="value-bool-for-int",
    ),
    pytest.param(
        c("model: {n_embed: 16.5}\n"),
        r"model\.n_embed must be an integer, got 16\.5",
        id="value-float-for-int",
    ),
    pytest.param(
        c("model: {n_layer: -1}\n"), r"model\.n_layer \(-1\) must be positive", id="value-negative"
    ),
    pytest.param(
        c("model: {dropout: 1.5}\n"),
        r"model\.dropout \(1\.5\) must be in \[0, 1\)",
        id="value-dropout-range",
    ),
    pytest.param(
        c("model: {n_embed: 30, n_head: 4}\n"),
        r"model\.n_embed \(30\) must be divisible by model\.n_head \(4\)",
        id="value-divisibility",
    ),
    pytest.param(c("train: {lr: .nan}\n"), r"train\.lr must be a number, got nan", id="value-nan"),
    pytest.param(
        c("train: {lr: 0.001, min_lr: 0.1}\n"),
        r"train\.min_lr \(0\.1\) must be <= ",
        id="value-min-lr-above-lr",
    ),
    pytest.param(
        c("train: {device: gpu}\n"),
        r"train\.device must be 'auto' or 'cpu'",
        id="value-not-a-choice",
    ),
    pytest.param(
        c("data: {dataset: some/corpus}\n"),
        r"data\.path .* and data\.dataset .* both",
        id="value-path-and-dataset",
    ),
    pytest.param(
        c("train: {seed: 99999999999999999999999}\n"),
        r"train\.seed .* must be in 0\.\.",
        id="value-seed-too-big",
    ),
    # --- config: --set ----------------------------------------------------------------------
    pytest.param(s("model.n_layer"), r"expected section\.key=value", id="set-no-equals"),
    pytest.param(s("n_layer=2"), r"the key must be section\.key", id="set-no-section"),
    pytest.param(
        s("modle.n_layer=2"),
        r"unknown section 'modle'\. Did you mean 'model'",
        id="set-unknown-section",
    ),
    pytest.param(s("train.max_step=2"), r"unknown key 'train\.max_step'", id="set-unknown-key"),
    pytest.param(s("model.n_layer=[1, 2]"), "must be a single scalar", id="set-list"),
    pytest.param(s("data.path=*.txt"), r"not a YAML scalar .*quote it", id="set-yaml-alias"),
    pytest.param(s("model.n_layer=" + "[" * 600), "not a YAML scalar", id="set-deep-nesting"),
    pytest.param(
        s("sample.top_p=0"), r"sample\.top_p \(0\.0\) must be in \(0, 1\]", id="set-out-of-range"
    ),
    # --- train: corpus ----------------------------------------------------------------------
    pytest.param(
        t(data={"path": "/nonexistent/corpus.txt"}),
        r"data\.path .* does not exist",
        id="train-corpus-missing",
    ),
    pytest.param(corpus_case(""), "the corpus is empty", id="train-corpus-empty"),
    pytest.param(
        corpus_case(b"\xff\xfe\x00binary"),
        r"is not UTF-8 text: .* offset 0",
        id="train-corpus-binary",
    ),
    pytest.param(
        corpus_case(None, "folder"),
        "is a folder with no .txt files",
        id="train-corpus-empty-folder",
    ),
    pytest.param(
        corpus_case("too short\n"),
        r"model\.context_length \(16\) needs at least 17",
        id="train-corpus-too-short",
    ),
    pytest.param(
        lambda e: ["train", str(e.tmp / "none.yaml")], "does not exist", id="train-config-missing"
    ),
    pytest.param(
        t(train={"batch_size": 0}),
        r"train\.batch_size \(0\) must be positive",
        id="train-bad-value",
    ),
    # --- train: devices, tokenizer, model size -----------------------------------------------
    pytest.param(
        t(train={"device": "mps"}),
        "'mps' but Apple's MPS backend is not available",
        id="train-no-mps",
    ),
    pytest.param(
        t(train={"dtype": "float16"}),
        r"train\.dtype \('float16'\) is not supported on cpu",
        id="train-fp16-on-cpu",
    ),
    pytest.param(
        t(data={"tokenizer": "/nonexistent/tokenizer.json"}),
        r"data\.tokenizer .* no such file",
        id="train-tokenizer-missing",
    ),
    pytest.param(
        lambda e: t(data={"tokenizer": str(e.file("tok.json", "not json"))})(e),
        "is not JSON",
        id="train-tokenizer-not-json",
    ),
    pytest.param(
        t(data={"tokenizer": "bpe", "vocab_size": 100}),
        r"data\.vocab_size \(100\) is too small for byte-level BPE",
        id="train-bpe-vocab-too-small",
    ),
    pytest.param(
        t(train={"init_from": "/nonexistent/gpt2"}),
        r"train\.init_from .* does not exist",
        id="train-init-from-missing",
    ),
    pytest.param(
        t(model={"n_layer": 10**9, "n_embed": 4096, "n_head": 64}),
        r"needs about .* has .*iB: lower model\.n_embed",
        id="train-model-too-big",
    ),
    # --- train: output and cache folders -----------------------------------------------------
    pytest.param(
        lambda e: t()(e)[:3] + [str(e.file("out", "a file")), "--no-progress"],
        "exists and is not a directory",
        id="train-out-is-a-file",
    ),
    pytest.param(
        lambda e: t()(e)[:3] + [str(e.file("f", "x") / "run"), "--no-progress"],
        "cannot write to output directory",
        id="train-out-below-a-file",
    ),
    pytest.param(
        lambda e: t()(e)[:3] + ["/proc/llmcli-robustness-run", "--no-progress"],
        "cannot write to output directory '/proc/",
        id="train-out-unwritable",
    ),
    pytest.param(
        t(data={"cache_dir": "/proc/llmcli-robustness-cache"}),
        "cannot create the token cache folder",
        id="train-cache-unwritable",
    ),
    # --- train: the run directory and --resume ------------------------------------------------
    pytest.param(
        lambda e: ["train", e.config(), "--out", str(e.copy("trained"))],
        r"already holds a run \(step 4\)",
        id="train-run-exists",
    ),
    pytest.param(t("--resume"), "nothing to resume", id="resume-nothing"),
    pytest.param(
        resume(lambda e, r: None, model={"n_embed": 32}),
        r"model\.n_embed: saved 16, config 32",
        id="resume-other-model",
    ),
    pytest.param(
        resume(lambda e, r: None, train={"optimizer": "muon"}),
        r"train\.optimizer='muon': it was trained with 'adamw'",
        id="resume-other-optimizer",
    ),
    pytest.param(
        resume(truncate("state.pt")),
        r"state\.pt' is corrupt or truncated",
        id="resume-truncated-state",
    ),
    pytest.param(
        resume(write("state.pt", b"")),
        r"state\.pt' is corrupt or truncated \(0 bytes",
        id="resume-empty-state",
    ),
    pytest.param(
        resume(pickle_as("state.pt")),
        r"state\.pt' holds Python objects .* refused",
        id="resume-pickled-state",
    ),
    pytest.param(
        resume(malformed_state),
        r"state\.pt' is incomplete or malformed .*: rng",
        id="resume-malformed-state",
    ),
    pytest.param(
        resume(bigger_tokenizer),
        r"tokenizer has \d+ tokens but the saved model has",
        id="resume-other-tokenizer",
    ),
    pytest.param(
        resume(remove("tokenizer.json")), "has no tokenizer.json", id="resume-no-tokenizer"
    ),
    # --- sample -----------------------------------------------------------------------------
    pytest.param(
        lambda e: ["sample", "--checkpoint", str(e.tmp / "absent")],
        "does not exist",
        id="sample-run-missing",
    ),
    pytest.param(
        lambda e: ["sample", "--checkpoint", str(e.file("f.txt", "x"))],
        "is a file, not a run directory",
        id="sample-run-is-a-file",
    ),
    pytest.param(
        on_run("sample", remove("model.safetensors", "best.safetensors")),
        "has no model.safetensors",
        id="sample-no-weights",
    ),
    pytest.param(
        on_run("sample", pickle_as("best.safetensors")),
        "not a safetensors file .*cannot run code",
        id="sample-pickled-weights",
    ),
    pytest.param(
        on_run("sample", truncate("best.safetensors", 0.7)),
        r"best\.safetensors' is truncated",
        id="sample-truncated-weights",
    ),
    pytest.param(
        on_run("sample", write("best.safetensors", b"")),
        r"truncated \(0 bytes\)",
        id="sample-empty-weights",
    ),
    pytest.param(
        on_run("sample", other_tokenizer),
        "come from different runs",
        id="sample-mismatched-tokenizer",
    ),
    pytest.param(
        on_run("sample", wider_config),
        r"model\.n_embed = 32 but the weights .* hold 16",
        id="sample-weights-do-not-fit-config",
    ),
    pytest.param(
        on_run("sample", write("tokenizer.json", b"\x89PNG\r\n\x1a\n\x00")),
        r"tokenizer\.json' is not a valid tokenizer",
        id="sample-binary-tokenizer",
    ),
    pytest.param(
        on_run("sample", write("config.yaml", "model: {n_head: 3}\n")),
        r"config\.yaml' is not a valid config: model\.n_embed",
        id="sample-bad-run-config",
    ),
    pytest.param(
        on_run("sample", None, "--prompt", "Жук"),
        r"vocabulary lacks: 'Ж', 'к', 'у'",
        id="sample-prompt-outside-vocab",
    ),
    pytest.param(
        on_run("sample", None, "--prompt-file", "{tmp}"),
        "is a directory",
        id="sample-prompt-file-directory",
    ),
    pytest.param(
        on_run("sample", None, "--temperature", "-0.5"),
        "temperature",
        id="sample-negative-temperature",
    ),
    pytest.param(
        on_run("sample", None, "--device", "tpu"),
        "device must be auto, cpu, cuda",
        id="sample-unknown-device",
    ),
    pytest.param(
        on_run("sample", None, "--max-new-tokens", "lots"),
        "Invalid value",
        id="sample-option-not-a-number",
    ),
    # --- inspect-attention --------------------------------------------------------------------
    pytest.param(
        on_run("inspect-attention", None, "--prompt", TOO_LONG),
        r"27 tokens long but the model's context_length is 16.*--truncate",
        id="inspect-prompt-too-long",
    ),
    pytest.param(
        on_run("inspect-attention", None, "--prompt", "ROMEO", "--layer", "1"),
        r"--layer 1 is out of range",
        id="inspect-layer-out-of-range",
    ),
    pytest.param(
        on_run("inspect-attention", None, "--prompt", "Жук"),
        "vocabulary lacks",
        id="inspect-prompt-outside-vocab",
    ),
    pytest.param(
        on_run("inspect-attention", None, "--prompt", "ROMEO", "--out", "{tmp}/f.txt"),
        "cannot create output folder|is not a folder",
        id="inspect-out-is-a-file",
    ),
    pytest.param(
        on_run("inspect-attention", pickle_as("best.safetensors"), "--prompt", "ROMEO"),
        "not a safetensors file",
        id="inspect-pickled-weights",
    ),
    pytest.param(
        on_run(
            "inspect-attention",
            truncate("model.safetensors", 0.3),
            "--prompt",
            "RO",
            "--weights",
            "last",
        ),
        r"model\.safetensors' is truncated",
        id="inspect-truncated-last-weights",
    ),
    pytest.param(
        on_run("inspect-attention", None, "--prompt", "RO", "--weights", "middle"),
        "weights must be 'best' or 'last'",
        id="inspect-unknown-weights",
    ),
    # --- eval ---------------------------------------------------------------------------------
    pytest.param(
        on_run("eval", None, "--data", "{tmp}/none.txt"),
        "--data .* does not exist",
        id="eval-data-missing",
    ),
    pytest.param(
        on_run("eval", None, "--data", "{tmp}"),
        "--data .* is a directory",
        id="eval-data-directory",
    ),
    pytest.param(
        lambda e: on_run("eval", None, "--data", str(e.file("b.txt", b"\xff\x00")))(e),
        r"--data .* is not UTF-8 text \(bad byte at offset 0\)",
        id="eval-data-binary",
    ),
    pytest.param(
        lambda e: on_run("eval", None, "--data", str(e.file("e.txt", "")))(e),
        "--data .* is empty",
        id="eval-data-empty",
    ),
    pytest.param(
        lambda e: on_run("eval", None, "--data", str(e.file("z.txt", "ROMEO~")))(e),
        "vocabulary lacks: '~'",
        id="eval-data-outside-vocab",
    ),
    pytest.param(
        on_run("eval", None),
        "cannot rebuild the validation split .* --data PATH",
        id="eval-corpus-gone",
    ),
    pytest.param(
        on_run("eval", None, "--steps", "0"),
        r"--steps \(0\) must be a positive",
        id="eval-zero-steps",
    ),
    pytest.param(
        on_run("eval", pickle_as("best.safetensors")),
        "not a safetensors file",
        id="eval-pickled-weights",
    ),
    # --- export -------------------------------------------------------------------------------
    pytest.param(
        on_run("export", None, "--out", "{tmp}/f.txt"),
        "exists and is a file",
        id="export-out-is-a-file",
    ),
    pytest.param(
        on_run("export", None, "--out", "{tmp}/hf", "--format", "onnx"),
        "--format 'onnx' is not supported",
        id="export-unknown-format",
    ),
    pytest.param(
        on_run("export", pickle_as("best.safetensors"), "--out", "{tmp}/hf"),
        "not a safetensors file",
        id="export-pickled-weights",
    ),
]


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_there_are_at_least_40_cases_over_every_command() -> None:
    ids = [p.id for p in CASES]
    assert len(ids) == len(set(ids)) >= 40
    for prefix in (
        "config",
        "value",
        "set",
        "train",
        "resume",
        "sample",
        "inspect",
        "eval",
        "export",
    ):
        assert sum(i.startswith(prefix + "-") for i in ids) >= 3, prefix


@pytest.mark.parametrize(("argv", "message"), CASES)
def test_bad_input_exits_2_with_a_message_and_no_traceback(
    argv: Argv, message: str, tmp_path: Path, shared: dict[str, Path], capsys, monkeypatch
) -> None:
    env = Env(tmp_path, shared)
    args = argv(env)
    monkeypatch.chdir(tmp_path)  # no run to fall back on, nothing written into the repository
    # Python's default limit, which a 600-deep YAML file exceeds (Inductor raises it to 2000 when
    # it compiles; the file would then parse and fail on its shape instead).
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        code, out, err = run_main(args, capsys)
    finally:
        sys.setrecursionlimit(limit)
    assert code == 2, (args, out, err)
    assert "Traceback" not in out + err
    text = " ".join(err.split())
    assert re.search(message, text), text
    assert not env.marker.exists(), "loading a checkpoint ran code"


def test_no_run_at_all_names_how_to_train_one(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for command in (["sample"], ["inspect-attention"], ["export", "--out", "hf"]):
        code, out, err = run_main(command, capsys)
        assert code == 2, command
        assert "no trained run found under 'checkpoints/'" in err
        assert "llmcli train tiny" in err and "Traceback" not in out + err


def test_a_failed_input_leaves_a_run_untouched(
    shared: dict[str, Path], tmp_path: Path, capsys
) -> None:
    # Refused commands must not have half-started anything in the run they were pointed at.
    run = Env(tmp_path, shared).copy("trained")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    env = Env(tmp_path, shared)
    for args in (
        ["train", env.config(), "--out", str(run), "--no-progress"],
        ["train", env.config(model={"n_embed": 32}), "--out", str(run), "--resume"],
    ):
        assert run_main(args, capsys)[0] == 2
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


@pytest.mark.slow
def test_a_real_process_exits_2_without_traceback(tmp_path: Path, shared: dict[str, Path]) -> None:
    argv, message = next(p.values for p in CASES if p.id == "config-alias-bomb")
    env = Env(tmp_path, shared)
    out = subprocess.run(
        [sys.executable, "-m", "llmcli", *argv(env)],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert out.stderr.startswith("error: ")
    assert re.search(message, " ".join(out.stderr.split()))
    assert not env.marker.exists()
