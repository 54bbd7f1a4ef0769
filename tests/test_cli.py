"""The CLI shell: version, help, exit statuses and the `config` command (llmcli/cli/); most
tests here start `python -m llmcli` in a new process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmcli import __version__

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # most start `python -m llmcli` in a new process


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmcli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_version_and_help() -> None:
    out = run_cli("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"llmcli {__version__}"
    for flag in ("-h", "--help"):
        out = run_cli(flag)
        assert out.returncode == 0
        assert "config" in out.stdout and "Usage" in out.stdout


def test_help_does_not_import_heavy_libraries() -> None:
    code = (
        "import sys; from llmcli.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'numpy', 'datasets', 'matplotlib', 'transformers')"
        " if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_config_prints_the_fully_resolved_yaml() -> None:
    out = run_cli("config", "configs/tiny.yaml", "--set", "train.max_steps=700")
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["train"]["max_steps"] == 700
    assert resolved["model"]["n_embed"] == 128
    assert resolved["sample"]["top_p"] == 1.0  # a default that tiny.yaml does not write


def test_divisibility_error_exits_2_without_traceback() -> None:
    out = run_cli("config", "configs/tiny.yaml", "--set", "model.n_head=3")
    assert out.returncode == 2
    assert "n_embed (128) must be divisible by model.n_head (3)" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    for args in (
        ("config",),
        ("config", "--bogus"),
        ("no-such-command",),
        ("config", str(tmp_path)),
        ("config", str(tmp_path / "none.yaml")),
    ):
        out = run_cli(*args)
        assert out.returncode == 2, args
        assert "Traceback" not in out.stderr + out.stdout
        assert out.stderr.strip(), args
        assert "error: " in out.stderr and "Error:" not in out.stderr, out.stderr  # one spelling


def test_near_misses_get_a_hint(tmp_path: Path, capsys, monkeypatch) -> None:
    from llmcli.cli import main

    def cli(*args: str) -> tuple[int, str]:  # in this process: no start-up to wait for
        with pytest.raises(SystemExit) as exit_:
            main(list(args))
        return exit_.value.code, capsys.readouterr().err

    code, err = cli("config", "tiney")
    assert code == 2 and "Did you mean 'tiny'?" in err
    code, err = cli("config", "tiny", "--set", "train.max_steps", "10")
    assert code == 2
    assert err.endswith(
        "error: Got unexpected extra argument(s) (10): --set takes KEY=VALUE as one word, e.g. "
        "--set train.max_steps=10\n"
    )
    (tmp_path / "checkpoints" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    code, err = cli("sample", "--checkpoint", "checkpoint/tiny", "--prompt", "hi")
    assert code == 2
    assert "run directory 'checkpoint/tiny' does not exist: did you mean 'checkpoints/tiny'?" in err


# --- options whose value may be left out: parsed by the real command line -----------------------


class Called(Exception):
    """Raised by a stand-in for the library function a command calls, once it has recorded what
    the command passed it."""


@pytest.fixture
def received(monkeypatch) -> dict[str, Any]:
    """What the commands passed to the library: the stand-ins record it and stop the command."""
    import llmcli.config
    import llmcli.evaluation.run
    import llmcli.generation.sample
    import llmcli.inspection.attention
    import llmcli.training.loop

    calls: dict[str, Any] = {}

    def load_config(config, overrides):
        calls["config"], calls["overrides"] = str(config), list(overrides)
        return real_load_config(config, overrides)

    def stand_in(name: str):
        def record(*args, **kwargs):
            calls[name] = (args, kwargs)
            raise Called

        return record

    real_load_config = llmcli.config.load_config
    monkeypatch.setattr(llmcli.config, "load_config", load_config)
    monkeypatch.setattr(llmcli.training.loop, "train", stand_in("train"))
    # eval's values are checked as its options are made, before evaluate_run: record them there.
    monkeypatch.setattr(llmcli.evaluation.run, "EvalOptions", stand_in("eval"))
    monkeypatch.setattr(llmcli.inspection.attention, "inspect_attention", stand_in("inspect"))
    monkeypatch.setattr(llmcli.generation.sample, "sample_run", stand_in("sample"))
    return calls


def call(argv: list[str]) -> None:
    from llmcli.cli import main

    with pytest.raises(Called):
        main(argv)


def fails(argv: list[str], capsys) -> str:
    """The command's stderr; it exits 2."""
    from llmcli.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, resume",
    [
        (["train", "tiny", "--resume"], True),
        (["train", "--resume", "tiny"], True),  # tiny is the CONFIG, not --resume's value
        (["train", "--resume", "--no-progress", "tiny"], True),
        (["train", "--resume", "auto", "tiny"], "auto"),
        (["train", "tiny", "--resume", "auto"], "auto"),
        (["train", "--resume=auto", "tiny"], "auto"),
        (["train", "tiny", "--resume", "strict"], True),
        (["train", "tiny", "--out", "o", "--set", "train.max_steps=3", "--resume"], True),
        (["train", "tiny", "--resume", "--out", "o", "--set", "train.max_steps=3"], True),
    ],
)
def test_train_resume_is_strict_when_bare(argv, resume, received) -> None:
    call(argv)
    assert received["config"] == "tiny"
    assert received["train"][1]["resume"] == resume


def test_a_bare_resume_is_no_other_options_value_nor_after_double_dash(received, capsys) -> None:
    err = fails(["train", "tiny", "--set", "--resume"], capsys)  # --set's value: a bad override
    assert received["overrides"] == ["--resume"] and "train" not in received
    assert "--set '--resume': expected section.key=value" in err
    err = fails(["train", "--set", "--resume"], capsys)  # so there is no CONFIG
    assert "Missing argument 'CONFIG'" in err
    err = fails(["train", "tiny", "--", "--resume"], capsys)  # an argument after --
    assert "unexpected extra argument(s) (--resume)" in err and "train" not in received
    assert "--resume takes no value, or 'auto'; got 'later'" in fails(
        ["train", "tiny", "--resume=later"], capsys
    )


@pytest.mark.parametrize(
    "argv, ablation, ablate",
    [
        (["eval", "--ablation", "--ablate", "1"], "zero", ["1"]),
        (["eval", "--ablate", "1", "--ablation"], "zero", ["1"]),
        (["eval", "--ablation", "mean"], "mean", []),
        (["eval", "--ablation=both"], "both", []),
        (["eval", "--ablation", "foo"], "foo", []),  # refused by EvalOptions, naming the methods
        (["eval", "--ablate", "1"], None, ["1"]),
        (["eval", "--ablate", "1", "--data", "t.txt", "--ablation"], "zero", ["1"]),
        (["eval", "--ablation", "--data", "t.txt", "--ablate", "0.1"], "zero", ["0.1"]),
    ],
)
def test_eval_ablation_is_zero_when_bare(argv, ablation, ablate, received) -> None:
    call(argv)
    _, kwargs = received["eval"]
    assert (kwargs["ablation"], list(kwargs["ablate"])) == (ablation, ablate)


def test_inspect_attention_ablation_is_zero_when_bare_and_a_prompt_may_read_ablation(
    received,
) -> None:
    call(["inspect-attention", "--ablation", "--layer", "1"])
    (_, prompts, options), _ = received["inspect"]
    assert (prompts, options.ablation, options.layers) == ([], "zero", (1,))
    call(["inspect-attention", "--prompt", "--ablation"])
    (_, prompts, options), _ = received["inspect"]
    assert (prompts, options.ablation) == (["--ablation"], None)
    call(["sample", "--prompt", "--ablation"])
    args, _ = received["sample"]
    assert args[1] == ["--ablation"]


def test_help_shows_the_options_that_may_be_bare(capsys) -> None:
    from llmcli.cli import main

    for command, option, help_ in (
        ("train", "--resume [auto]", "Continue the run saved in the run directory, exactly;"),
        ("eval", "--ablation METHOD", "How --ablate removes a head: zero"),
        ("inspect-attention", "--ablation METHOD", "Add each head's loss increase when it is"),
    ):
        with pytest.raises(SystemExit) as exc:
            main([command, "--help"])
        assert exc.value.code == 0
        out = " ".join(capsys.readouterr().out.split())  # the help as one line, unwrapped
        assert f"{option} {help_}" in out


def test_usage_lines_name_the_arguments_without_braces(capsys) -> None:
    from llmcli.cli import main

    for command, usage in (
        ("train", "train [OPTIONS] CONFIG"),
        ("prepare-data", "prepare-data [OPTIONS] CONFIG"),
        ("bench", "bench [OPTIONS] CONFIG"),
        ("config", "config [OPTIONS] [CONFIG]"),
        ("compare", "compare [OPTIONS] RUN..."),
        ("eval", "eval [OPTIONS]"),
    ):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert capsys.readouterr().out.splitlines()[0] == f"Usage: llmcli {usage}"


def test_a_closed_stdout_ends_quietly_with_status_0(tmp_path) -> None:
    """`llmcli ... | head`: the reader leaves; no traceback, and not the status of a failure."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "llmcli", "config", "tiny"],
            stdout=write,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            cwd=tmp_path,
            timeout=120,
        )
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (0, b"")


def test_config_list_gives_whole_sentences_wrapped_at_80_columns() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "llmcli", "config", "--list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) < 80
    entries: dict[str, str] = {}  # name -> its description, its wrapped lines joined
    for line in lines:
        if not line.startswith(" "):
            name, entries[line.split()[0]] = line.split()[0], ""
        entries[name] += " " + " ".join(line.split()[0 if line.startswith(" ") else 1 :])
    assert set(entries) == {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    assert all(text.endswith(".") for text in entries.values()), entries  # whole sentences
    assert "2 CPU cores (`llmcli train speedrun-cpu`, start to exit;" in entries["speedrun-cpu"]


def test_an_error_wraps_at_spaces_on_an_80_column_terminal(tmp_path) -> None:
    from terminal_helpers import Terminal

    term = Terminal(["llmcli", "train", "grpo"], columns=80, cwd=tmp_path)
    assert term.wait(120) == 2
    written = [line for line in term.raw.decode().split("\r\n") if line]
    # As written (before the terminal breaks anything): short lines, or one word too long
    # to break (the folder's path).
    assert all(len(line) < 80 or " " not in line.strip() for line in written), written
    assert len(written) > 1 and written[0].startswith("error: ")
    assert all(line.startswith("  ") for line in written[1:])
    text = " ".join(line.strip() for line in written)
    assert "error: train.init_from ('checkpoints/chat') does not exist: no folder" in text
    assert "It is the run that `llmcli train chat` makes: train it first, in this folder" in text


@pytest.mark.parametrize("args", [(), ("sae",)])
def test_a_command_group_alone_shows_its_help_not_an_error_holding_it(args) -> None:
    out = run_cli(*args)
    assert out.returncode == 2  # as click's: nothing was done
    assert out.stderr.startswith(f"Usage: llmcli {' '.join(args)}".rstrip() + " [OPTIONS] COMMAND")
    assert "error" not in out.stderr.lower().split("options:")[0]
    assert out.stderr.count("Usage:") == 1
