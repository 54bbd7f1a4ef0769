"""README.md against the code (docs/readme.py reads it): the config table is the generated one and
names every key, a shown output is what its command prints, and every cheap command in README's
code blocks runs as a new user would type it, in order, from an empty folder."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, save_tiny_run

from llmcli.cli import main
from llmcli.config.shipped import shipped_configs
from llmcli.data.tokenizer import CharTokenizer
from llmcli.generation.sample import format_samples, sample_run

pytestmark = pytest.mark.usefixtures("one_thread")


def _load_tool():
    spec = importlib.util.spec_from_file_location("readme_tool", ROOT / "docs" / "readme.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["readme_tool"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


readme = _load_tool()
TEXT = (ROOT / "README.md").read_text(encoding="utf-8")


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


# --- the config table ------------------------------------------------------------------------


def test_the_config_table_is_generated_and_names_every_key_config_prints(capsys) -> None:
    start = TEXT.index(readme.TABLE_START)
    table = TEXT[start : TEXT.index(readme.TABLE_END) + len(readme.TABLE_END)]
    assert table == readme.config_table(), "run: python docs/readme.py --write"
    code, out, _ = cli(capsys, "config", "tiny")
    printed = {f"{s}.{k}" for s, values in yaml.safe_load(out).items() for k in values}
    assert code == 0 and len(printed) > 60
    assert printed - readme.table_keys(table) == set()
    assert {"train.muon_momentum", "train.threads", "sample.ignore_eos"} <= printed


# --- reading commands ------------------------------------------------------------------------


def test_shell_words_split_as_bash_does() -> None:
    assert readme.shell_words(r"llmcli lens --prompt $'a b\n\nKIN'  # a comment") == [
        "llmcli",
        "lens",
        "--prompt",
        "a b\n\nKIN",
    ]
    assert readme.shell_words(r'llmcli sample --stop "\n\n" | jq -r "." > x') == [
        "llmcli",
        "sample",
        "--stop",
        r"\n\n",
        "|",
        "jq",
        "-r",
        ".",
        ">",
        "x",
    ]
    block = readme.Block("bash", 0, ["a 1 && b 2 \\", "   --c 3   # why", "", "# alone"])
    assert [c.words for c in readme.command_lines(block)] == [["a", "1"], ["b", "2", "--c", "3"]]


def test_a_shown_output_is_rewritten_to_what_its_command_prints(tmp_path) -> None:
    tokenizer = CharTokenizer.train(["ROMEO: what say you, my lord?\n"])
    raw = {"model": {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 16}}
    run = save_tiny_run(tmp_path / "run", tokenizer, raw, sharpen=4.0)
    command = "llmcli sample --seed 3 --max-new-tokens 12 --prompt ROMEO"
    stale = f"Before.\n\n<!-- output: {command} -->\n```\nstale text\n```\n\nAfter.\n"
    new, changed = readme.with_outputs(stale, run)
    assert changed == [command]
    samples = sample_run(run, ["ROMEO"], {"seed": 3, "max_new_tokens": 12})
    expected = [line.rstrip() for line in format_samples(samples).rstrip("\n").splitlines()]
    shown = "\n".join(expected)
    assert new == f"Before.\n\n<!-- output: {command} -->\n```\n{shown}\n```\n\nAfter.\n"
    assert readme.with_outputs(new, run) == (new, [])
    part = readme.Shown(command, "b", "d", readme.Block("", 0, []))
    assert readme.select("a\nb 1\nc  \nd\ne\n", part) == ["b 1", "c"]
    part = readme.Shown(command, None, None, readme.Block("", 0, []), drop="wrote")
    assert readme.select("t 1\nt 2\nwrote x\n\nh 1\n\n", part) == ["t 1", "t 2", "", "h 1"]


# --- every cheap command, from an empty folder -----------------------------------------------

# Commands the test does not run, by how they start, and why.
SKIP = {
    "pip": "installs packages (tests/test_wheel.py installs the wheel)",
    "python -m pytest": "the test suite itself",
    "torchrun": "DDP across processes (tests/test_fault_tolerance.py runs 2 ranks)",
    "lm_eval": "another program (benchmarks/lm_eval_check.py)",
    "curl": "needs `llmcli serve` running (tests/test_serve.py)",
    "llama-completion": "llama.cpp (benchmarks/gguf_check.py)",
    "tensorboard": "another program",
    "llmcli serve": "a server that runs until Ctrl-C (tests/test_serve.py)",
    "llmcli export --format gguf": "needs the gguf extra and a BPE run (README: a char run is "
    "refused; tests/test_gguf.py)",
}
# What makes a command cheap, appended to its words (a repeated option's last value wins).
CHEAP = {
    "train": [
        *("--set", "train.max_steps=2", "--set", "train.eval_steps=1"),
        *("--set", "train.log_interval=1", "--no-progress"),
    ],
    "sample": ["--max-new-tokens", "24"],
    "eval": ["--steps", "2", "--no-progress"],
    "inspect-attention": ["--ablation-steps", "1", "--no-pictures", "--no-progress"],
}
# Files README's commands expect the user to have.
USER_FILES = {"prompts.txt": "ROMEO:\nJULIET:\n"}


CLONE = "needs the repository's files (README says: from a clone)"
NO_TENSORBOARD = "needs the tensorboard extra"
NO_CUDA = "asks for a CUDA device, and there is none here"
OTHER = "another program"


def _skip_reason(command) -> str | None:
    if "from a clone" in command.line:
        return CLONE
    text = " ".join(command.words)
    for start, reason in SKIP.items():
        if text.startswith(start):
            return reason
    if "train.logger=tensorboard" in text and importlib.util.find_spec("tensorboard") is None:
        return NO_TENSORBOARD
    if "--device cuda" in text and not torch.cuda.is_available():
        return NO_CUDA
    if command.words[0] not in ("llmcli", "printf"):  # printf writes a file a command reads
        return OTHER
    return None


def _cheap(words: list[str]) -> list[str]:
    extra = CHEAP.get(words[1], [])
    if words[1] == "inspect-attention" and "--ablation" not in words:
        extra = extra[2:]
    return words[1:] + extra


def _runs_first(words: list[str], folder: Path) -> list[list[str]]:
    """`llmcli train NAME` for each `checkpoints/NAME` a compare needs that no command made."""
    if words[1] != "compare":
        return []
    needed = [Path(w).name for w in words if w.startswith("checkpoints/") and "*" not in w]
    return [
        ["llmcli", "train", name]
        for name in needed
        if not (folder / "checkpoints" / name).exists() and name in shipped_configs()
    ]


def test_every_cheap_readme_command_runs_from_an_empty_folder(
    tmp_path, monkeypatch, capsys
) -> None:
    folder = tmp_path / "new-user"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setenv("LLMCLI_CACHE", str(tmp_path / "cache"))
    for name, text in USER_FILES.items():
        (folder / name).write_text(text)
    failures, ran, skipped = [], [], []
    threads = torch.get_num_threads()
    for block in readme.code_blocks(TEXT):
        if block.lang == "python" and "load_run" in "\n".join(block.lines):
            try:
                exec(compile("\n".join(block.lines), "README", "exec"), {})
                ran.append("the hook points example (python)")
            except Exception as exc:  # noqa: BLE001 (reported with the rest)
                failures.append(f"README python block at line {block.start}: {exc!r}")
            continue
        if block.lang != "bash":
            continue
        for command in readme.command_lines(block):
            reason = _skip_reason(command)
            if reason is not None:
                skipped.append((" ".join(command.words), reason))
                continue
            words = command.before_pipe()
            if words[0] != "llmcli":  # printf > romeo.txt
                subprocess.run(["bash", "-c", command.shell], cwd=folder, check=True)
                ran.append(command.shell)
                continue
            for first in _runs_first(words, folder):
                cli(capsys, *_cheap(first))
            monkeypatch.setattr(sys, "stdin", io.StringIO("ROMEO:\n"))
            code, _, err = cli(capsys, *_cheap(words))
            torch.set_num_threads(threads)
            ran.append(" ".join(words))
            if code != 0:
                failures.append(f"{' '.join(words)} exited {code}: {err.strip()[-600:]}")
    assert not failures, "\n\n".join(failures)
    assert len(ran) >= 20, ran
    known = {*SKIP.values(), CLONE, NO_TENSORBOARD, NO_CUDA, OTHER}
    assert {reason for _, reason in skipped} <= known, skipped
