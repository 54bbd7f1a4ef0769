"""`llmcli sample --interactive`: answers to a scripted stdin equal `llmcli sample`'s."""

from __future__ import annotations

import io
import json
import random
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import default_sigint, save_tiny_run
from terminal_helpers import ctrl_c_leaves_the_session_on

from llmcli.cli import main
from llmcli.config import SampleConfig
from llmcli.config.sample import SETTING_KEYS, setting_info
from llmcli.data.tokenizer import CharTokenizer
from llmcli.errors import InputError
from llmcli.generation.interactive import apply_command

ROOT = Path(__file__).resolve().parents[1]
TEXT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me!\n"

pytestmark = pytest.mark.usefixtures("one_thread")


def make_run(run_dir: Path, tokenizer=None) -> Path:
    raw = {
        "model": {"n_layer": 2, "n_head": 2, "n_embed": 32, "context_length": 16},
        "sample": {"max_new_tokens": 12, "temperature": 1.0, "top_k": 10, "seed": 3},
    }
    return save_tiny_run(
        run_dir, tokenizer or CharTokenizer.train([TEXT]), raw, seed=0, sharpen=8.0
    )


def cli(capsys, *args: str, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def sampled(capsys, run_dir: Path, prompt: str, *settings: str) -> str:
    """What `llmcli sample` generates after `prompt` with these options."""
    args = ("sample", "--checkpoint", str(run_dir), "--prompt", prompt, "--json", *settings)
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    completion = json.loads(out)["completion"]
    return completion if completion.endswith("\n") else completion + "\n"


def test_answers_equal_llmcli_sample_and_settings_take_effect(tmp_path, capsys, monkeypatch):
    run_dir = make_run(tmp_path / "run")
    script = [
        "ROMEO",
        "/temp 0.5",  # a unique prefix
        "/top-k 5",
        "ROMEO",
        "/temperature -1",  # refused: the previous temperature stays
        "/seed 11",
        "",  # an empty line asks nothing
        "ROMEO",
        "/top_k null",
        "JULIET:\\n",  # \n is a newline
        "/settings",
    ]
    code, out, err = cli(
        capsys,
        "sample", "--checkpoint", str(run_dir), "--interactive", "--max-new-tokens", "15",
        stdin="\n".join(script) + "\n", monkeypatch=monkeypatch,
    )  # fmt: skip
    assert code == 0, err
    n = ("--max-new-tokens", "15")
    answers = [
        sampled(capsys, run_dir, "ROMEO", *n),
        sampled(capsys, run_dir, "ROMEO", *n, "--temperature", "0.5", "--top-k", "5"),
        sampled(capsys, run_dir, "ROMEO", *n, "--temperature", "0.5", "--top-k", "5", "--seed",
                "11"),
        # top_k null keeps every token, as a top_k above the vocabulary does.
        sampled(capsys, run_dir, "JULIET:\n", *n, "--temperature", "0.5", "--seed", "11",
                "--top-k", "1000"),
    ]  # fmt: skip
    assert out == "".join(answers)
    assert len(set(answers[:3])) == 3  # each change gave another answer
    assert "temperature = 0.5" in err and "top_k = 5" in err and "seed = 11" in err
    assert "--temperature / sample.temperature (-1) must be a number >= 0" in err
    assert "temperature=0.5 top_k=None top_p=1.0 seed=11" in err


@pytest.mark.parametrize("quit_line", ["/quit", "/exit", "/bye", "exit", " quit "])
def test_a_quit_line_ends_the_session_as_in_chat(tmp_path, capsys, monkeypatch, quit_line):
    run_dir = make_run(tmp_path / "run")
    code, out, err = cli(
        capsys,
        "sample", "--checkpoint", str(run_dir), "--interactive", "--max-new-tokens", "5",
        stdin=f"ROMEO\n{quit_line}\nJULIET\n", monkeypatch=monkeypatch,
    )  # fmt: skip
    assert code == 0 and "error" not in err, err
    assert out == sampled(capsys, run_dir, "ROMEO", "--max-new-tokens", "5")  # one answer


def test_commands_are_checked_by_sample_config():
    config = SampleConfig()
    new, message = apply_command(config, "/top_p 0.9", context_length=16)
    assert new.top_p == 0.9 and new.temperature == config.temperature and "top_p" in message
    assert apply_command(config, "/context_keep 8", 16)[0].context_keep == 8
    # A unique prefix is the setting it begins, as a shell completes it.
    assert apply_command(config, "/temp 0.3", 16) == (
        replace(config, temperature=0.3),
        "temperature = 0.3",
    )
    assert apply_command(config, "/max 5", 16)[0].max_new_tokens == 5
    for line, named in [
        ("/context_keep 16", "context_keep"),  # must be below the context
        ("/top_k 0", "top_k"),
        ("/temprature 1", r"unknown command /temprature\. Did you mean /temperature\?"),
        ("/top 5", r"unknown command /top\. Did you mean /top_k or /top_p\?"),
        ("/seed", "needs a value"),
        ("/top_k [", r"/top_k \[: the value is not a YAML scalar"),
        ("/seed [1, 2]", "must be a single scalar"),
    ]:
        with pytest.raises(InputError, match=named):
            apply_command(config, line, 16)
    # /help lists every setting with its current value and its help from SampleConfig's field.
    help_ = " ".join(apply_command(replace(config, top_k=50), "/help", 16)[1].split())
    assert "/top_k 50 Keep the k most likely tokens" in help_
    for key in SETTING_KEYS:
        assert f"/{key} " in help_ and " ".join(setting_info(key)["help"].split()) in help_
    assert "/settings" in help_ and "Ctrl-C" in help_ and "Ctrl-D" in help_ and "\\n" in help_


def test_interactive_refuses_options_it_cannot_use(tmp_path, capsys, monkeypatch):
    run_dir = make_run(tmp_path / "run")
    for extra in (("--json",), ("--num-samples", "2")):
        code, _, err = cli(
            capsys, "sample", "--checkpoint", str(run_dir), "--interactive", *extra,
            stdin="R\n", monkeypatch=monkeypatch,
        )  # fmt: skip
        assert code == 2 and "--interactive" in err


def test_lines_that_cannot_be_answered_get_a_reason_and_the_next_lines_their_answers(
    tmp_path, capsys, monkeypatch
):
    run_dir = make_run(tmp_path / "run")
    rng = random.Random(0)
    # Random bytes >= 0x80: never UTF-8 of the vocabulary's characters (ASCII), so each line of
    # them is refused, as not UTF-8 or as characters the vocabulary lacks.
    noise = [bytes(rng.randrange(0x80, 0x100) for _ in range(rng.randrange(1, 40))) for _ in "ab"]
    long = "ROMEO: " * 300  # far past the context (16): answered from its last 16 tokens
    script = [
        b"ROMEO",
        *noise,
        b"JUL\xffIET",  # a byte that is not UTF-8 inside a line
        "JULIET: café".encode(),  # characters outside the vocabulary
        long.encode(),
        b"/top_k [",  # not a YAML scalar
        b"/seed \xff",
        b"/" + bytes(range(0x80, 0x90)),
        b"JULIET",
    ]
    # A real stdin: a strict UTF-8 text layer over the bytes that came in.
    stdin = io.TextIOWrapper(io.BytesIO(b"\n".join(script) + b"\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    code, out, err = cli(capsys, "sample", "--checkpoint", str(run_dir), "--interactive")
    assert code == 0, err
    answers = [sampled(capsys, run_dir, prompt) for prompt in ("ROMEO", long, "JULIET")]
    assert out == "".join(answers)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == len(script) - 3  # every other line: a reason
    assert sum("is not UTF-8 text" in line and "iconv" in line for line in errors) >= 3
    assert "vocabulary lacks: 'c', 'é'. Remove them" in err
    assert "/top_k [: the value is not a YAML scalar" in err
    assert "the prompt is longer than the model's context_length (16 tokens)" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_and_the_next_prompt_is_answered(tmp_path, capsys):
    # No end-of-text token: the first answer cannot end by itself before SIGINT.
    run_dir = make_run(tmp_path / "run", CharTokenizer(sorted(set(TEXT)), eot=None))
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmcli", "sample", "--checkpoint", str(run_dir),
         "--interactive", "--max-new-tokens", "1000000"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=default_sigint,
    )  # fmt: skip
    try:
        proc.stdin.write(b"ROMEO\n/max_new_tokens 9\nJULIET\n")
        proc.stdin.close()  # the end of input (Ctrl-D) after the last prompt
        proc.stdin = None  # (so that communicate does not flush it)
        first = proc.stdout.read(1)  # the first answer is streaming
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert b"stopped (Ctrl-C)" in err and b"Traceback" not in err
    expected = sampled(capsys, run_dir, "JULIET", "--max-new-tokens", "9")
    assert (first + out).decode().endswith("\n" + expected)


@pytest.mark.slow
def test_ctrl_c_from_a_terminal_never_ends_the_session(tmp_path):
    run_dir = make_run(tmp_path / "run", CharTokenizer(sorted(set(TEXT)), eot=None))
    args = ["llmcli", "sample", "--checkpoint", str(run_dir), "--interactive"]
    ctrl_c_leaves_the_session_on(
        [*args, "--max-new-tokens", "1000000"], "> ", b"ROMEO", "stopped (Ctrl-C)"
    )
