"""`llmcli sample` end to end on tiny run directories made with `save_model_run`."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import default_sigint, save_tiny_run
from test_batching import count_checks

from llmcli.cli import main
from llmcli.config import SampleConfig
from llmcli.data.tokenizer import BPETokenizer, CharTokenizer
from llmcli.device import usable_cpus
from llmcli.generation.batching import SampleOptions
from llmcli.generation.engine import generate_ids
from llmcli.generation.sample import sample_run
from llmcli.runs.loading import load_run

ROOT = Path(__file__).resolve().parents[1]
TEXT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me!\n"


pytestmark = pytest.mark.usefixtures("one_thread")


def make_run(run_dir: Path, tokenizer, sample: dict | None = None, seed: int = 0) -> Path:
    defaults = {"max_new_tokens": 20, "temperature": 1.0, "top_k": 10, "seed": 3}
    raw = {
        "model": {"n_layer": 2, "n_head": 2, "n_embed": 32, "context_length": 16},
        "sample": {**defaults, **(sample or {})},
    }
    return save_tiny_run(run_dir, tokenizer, raw, seed=seed, sharpen=8.0)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "tiny", CharTokenizer.train([TEXT]))


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def expected_completion(run_dir: Path, prompt: str, n: int, seed: int, **kw) -> str:
    run = load_run(run_dir)
    ids = run.tokenizer.encode(prompt) if prompt else [run.tokenizer.encode("\n")[0]]
    config = dataclasses.replace(run.config.sample, max_new_tokens=n, seed=seed, **kw)
    [new] = generate_ids(run.model, [ids], config)
    eot = run.tokenizer.eot_id
    if eot in new:  # a sample ends at its end-of-text token, which is not printed
        new = new[: new.index(eot)]
    return run.tokenizer.decode(new)


def test_prompt_and_continuation_with_run_defaults(capsys, run_dir) -> None:
    code, out, err = cli(
        capsys, "sample", "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--no-stream"
    )
    assert code == 0, err
    assert out == "ROMEO:" + expected_completion(run_dir, "ROMEO:", 20, seed=3) + "\n"
    code, streamed, _ = cli(
        capsys, "sample", "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--stream"
    )
    assert code == 0 and streamed == out


def test_options_override_the_config(capsys, run_dir) -> None:
    code, out, _ = cli(
        capsys,
        "sample",
        "--checkpoint",
        str(run_dir),
        "--prompt",
        "JULIET",
        "--max-new-tokens",
        "7",
        "--temperature",
        "0",
        "--no-stream",
    )
    assert code == 0
    run = load_run(run_dir)
    greedy = SampleConfig(max_new_tokens=7, temperature=0.0)
    [ids] = generate_ids(run.model, [run.tokenizer.encode("JULIET")], greedy)
    assert out == "JULIET" + run.tokenizer.decode(ids) + "\n"
    code, out, _ = cli(
        capsys,
        "sample",
        "--checkpoint",
        str(run_dir),
        "--prompt",
        "JULIET",
        "--top-k",
        "3",
        "--top-p",
        "0.6",
        "--seed",
        "5",
        "--no-stream",
    )
    assert code == 0
    config = SampleConfig(max_new_tokens=20, temperature=1.0, top_k=3, top_p=0.6, seed=5)
    [ids] = generate_ids(run.model, [run.tokenizer.encode("JULIET")], config)
    assert out == "JULIET" + run.tokenizer.decode(ids) + "\n"


def test_context_policy_and_keep_options_and_config(capsys, run_dir, tmp_path) -> None:
    # The prompt (6 tokens) and 20 new ones cross the context (16): the policies differ.
    texts = {}
    for policy, keep in (("exact", None), ("shift", None), ("shift", 3)):
        args = ["--context-policy", policy] + (
            [] if keep is None else ["--context-keep", str(keep)]
        )
        code, out, err = cli(
            capsys, "sample", "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--json", *args
        )
        assert code == 0, err
        texts[policy, keep] = json.loads(out)["completion"]
        expected = expected_completion(
            run_dir, "ROMEO:", 20, seed=3, context_policy=policy, context_keep=keep
        )
        assert texts[policy, keep] == expected
    assert len(set(texts.values())) == 3
    # The run's own sample.context_policy / context_keep are the defaults.
    shifted = make_run(
        tmp_path / "shifted",
        CharTokenizer.train([TEXT]),
        {"context_policy": "shift", "context_keep": 3},
    )
    code, out, _ = cli(
        capsys, "sample", "--checkpoint", str(shifted), "--prompt", "ROMEO:", "--json"
    )
    assert code == 0 and json.loads(out)["completion"] == texts["shift", 3]
    # A keep given with exact changes nothing, and says so.
    args = ["sample", "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--json"]
    code, out, err = cli(capsys, *args, "--context-policy", "exact", "--context-keep", "3")
    assert code == 0 and json.loads(out)["completion"] == texts["exact", None]
    assert "--context-keep is for the shift policy" in err


def test_num_samples_is_one_batch_with_seeds_seed_plus_i(capsys, run_dir) -> None:
    code, out, _ = cli(
        capsys,
        "sample",
        "--checkpoint",
        str(run_dir),
        "--prompt",
        "ROMEO:",
        "--num-samples",
        "3",
        "--seed",
        "40",
        "--json",
    )
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["seed"] for r in rows] == [40, 41, 42]
    for i, r in enumerate(rows):
        assert r["prompt"] == "ROMEO:" and r["tokens"] == 20 and r["tokens_per_s"] > 0
        assert r["completion"] == expected_completion(run_dir, "ROMEO:", 20, seed=40 + i)
    assert len({r["completion"] for r in rows}) == 3
    code, text, _ = cli(
        capsys,
        "sample",
        "--checkpoint",
        str(run_dir),
        "--prompt",
        "ROMEO:",
        "--num-samples",
        "3",
        "--seed",
        "40",
        "--no-stream",
    )
    blocks = text.split("---------------\n")
    assert [b.rstrip("\n") for b in blocks] == ["ROMEO:" + r["completion"] for r in rows]


def test_prompt_file_batch_keeps_order_and_equals_alone(capsys, run_dir, tmp_path) -> None:
    prompts = ["ROMEO: But soft, what light", "J", "", "JULIET: Ay me!\nROMEO: what light through"]
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(prompts))
    code, out, err = cli(
        capsys,
        "sample",
        "--checkpoint",
        str(run_dir),
        "--prompt-file",
        str(path),
        "--seed",
        "9",
        "--json",
        "--max-new-tokens",
        "24",
    )
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    assert "context_length" in err  # the last prompt (35 chars) is longer than 16
    for i, (p, r) in enumerate(zip(prompts, rows, strict=True)):
        code, alone, _ = cli(
            capsys,
            "sample",
            "--checkpoint",
            str(run_dir),
            "--prompt",
            p,
            "--seed",
            str(9 + i),
            "--json",
            "--max-new-tokens",
            "24",
        )
        assert json.loads(alone)["completion"] == r["completion"], p
        assert r["completion"] == expected_completion(run_dir, p[-16:], 24, seed=9 + i)


def test_stop_string_ends_the_sample_and_is_not_printed(capsys, run_dir) -> None:
    full = expected_completion(run_dir, "ROMEO:", 20, seed=3)
    stop = full[8:10]  # text that does appear, at position 8 at the latest
    code, out, _ = cli(
        capsys,
        "sample",
        "--checkpoint",
        str(run_dir),
        "--prompt",
        "ROMEO:",
        "--stop",
        stop,
        "--stop",
        "@@",
        "--stream",
    )
    assert code == 0
    assert out == "ROMEO:" + full[: full.index(stop)] + "\n"


def test_stop_understands_escaped_newlines(capsys, run_dir) -> None:
    # A seed whose sample holds a newline (the tiny test model may end one early instead).
    seed, full = next(
        (s, text)
        for s in range(4, 40)
        if "\n" in (text := expected_completion(run_dir, "ROMEO:", 60, seed=s))
    )
    code, out, _ = cli(
        capsys,
        "sample",
        "--checkpoint",
        str(run_dir),
        "--prompt",
        "ROMEO:",
        "--stop",
        "\\n",
        "--max-new-tokens",
        "60",
        "--seed",
        str(seed),
        "--json",
    )
    assert code == 0
    assert json.loads(out)["completion"] == full[: full.index("\n")]


def test_empty_prompt_and_stdin(capsys, run_dir, monkeypatch) -> None:
    code, out, _ = cli(
        capsys, "sample", "--checkpoint", str(run_dir), "--prompt", "", "--no-stream"
    )
    assert code == 0 and out.rstrip("\n") == expected_completion(run_dir, "", 20, seed=3).rstrip(
        "\n"
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO("ROMEO:"))
    code, out2, _ = cli(
        capsys, "sample", "--checkpoint", str(run_dir), "--prompt", "-", "--no-stream"
    )
    assert (
        code == 0 and out2 == "ROMEO:" + expected_completion(run_dir, "ROMEO:", 20, seed=3) + "\n"
    )


def test_bpe_run_starts_empty_prompt_at_end_of_text(capsys, tmp_path) -> None:
    tok = BPETokenizer.train([TEXT * 5], vocab_size=280)
    run_dir = make_run(tmp_path / "bpe", tok)
    code, out, _ = cli(
        capsys,
        "sample",
        "--checkpoint",
        str(run_dir),
        "--json",
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
    )
    assert code == 0
    row = json.loads(out)
    run = load_run(run_dir)
    [new] = generate_ids(
        run.model, [[tok.eot_id]], SampleConfig(max_new_tokens=12, temperature=0.0)
    )
    if tok.eot_id in new:  # the sample ends at end-of-text, which is not printed
        new = new[: new.index(tok.eot_id)]
        assert row["stop_reason"] == "stop"
    assert row["completion"] == tok.decode(new)


def test_latest_run_is_used_and_named(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "sample", "--prompt", "ROMEO:")
    assert code == 2 and "llmcli train tiny" in err
    make_run(tmp_path / "checkpoints" / "old", CharTokenizer.train([TEXT]), seed=1)
    newest = make_run(tmp_path / "checkpoints" / "new", CharTokenizer.train([TEXT]))
    os.utime(tmp_path / "checkpoints" / "old" / "model.safetensors", (1, 1))
    code, out, err = cli(capsys, "sample", "--prompt", "ROMEO:", "--no-stream")
    assert code == 0
    assert f"using the latest text run: {Path('checkpoints') / 'new'}, at step 0\n" in err
    assert out == "ROMEO:" + expected_completion(newest, "ROMEO:", 20, seed=3) + "\n"

    # A newer chat run does not take its place: sample keeps to text, and says what it left.
    chat = tmp_path / "checkpoints" / "chat"
    shutil.copytree(newest, chat)
    (chat / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    os.utime(newest / "model.safetensors", (2, 2))
    code, out2, err = cli(capsys, "sample", "--prompt", "ROMEO:", "--no-stream")
    assert code == 0 and out2 == out
    assert (
        f"using the latest text run: {Path('checkpoints') / 'new'}, at step 0 (the newer chat "
        "run is " in err
    )
    assert f"--checkpoint {Path('checkpoints') / 'chat'} picks it)" in err


def test_threads_option_gives_the_same_text_and_restores_the_count(capsys, run_dir) -> None:
    import torch

    before = torch.get_num_threads()
    texts = []
    for threads in ([], ["--threads", "1"], ["--threads", str(min(2, usable_cpus()))]):
        args = ["sample", "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--json", *threads]
        code, out, err = cli(capsys, *args)
        assert code == 0, err
        texts.append(json.loads(out)["completion"])
        assert torch.get_num_threads() == before
    assert texts[0] == texts[1] == texts[2] == expected_completion(run_dir, "ROMEO:", 20, seed=3)


def test_sample_run_checks_the_settings_once(run_dir, monkeypatch) -> None:
    calls = count_checks(monkeypatch)
    options = SampleOptions(num_samples=2)
    samples = sample_run(run_dir, ["ROMEO:", "J"], {"max_new_tokens": 4, "top_p": 0.9}, options)
    # Each config once, as it is made: the options alone (checked before the run loads, on the
    # defaults), the run's settings as its config loads, then the run's with the options applied.
    assert len(samples) == 4 and calls == [(0.8, 200, 0.9), (1.0, 10, 1.0), (1.0, 10, 0.9)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--temperature", "-1"],
            "--temperature / sample.temperature (-1.0) must be a number >= 0",
        ),
        (["--top-p", "0"], "--top-p / sample.top_p (0.0) must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p / sample.top_p (1.5) must be in (0, 1]"),
        (["--top-k", "0"], "--top-k / sample.top_k (0) must be an integer >= 1"),
        (
            ["--max-new-tokens", "0"],
            "--max-new-tokens / sample.max_new_tokens (0) must be an integer >= 1",
        ),
        (["--num-samples", "0"], "--num-samples (0) must be an integer >= 1"),
        (
            ["--context-policy", "slide"],
            "--context-policy / sample.context_policy ('slide') must be one of exact, shift",
        ),
        (["--context-keep", "0"], "--context-keep / sample.context_keep (0) must be in 1..15"),
        (["--context-keep", "16"], "--context-keep / sample.context_keep (16) must be in 1..15"),
        (["--threads", "0"], "--threads (0) must be in 1.."),
        (["--threads", "100000"], "--threads (100000) must be in 1.."),  # a segfault in torch
        (["--prompt", "ROMEO€ and ЖЖ"], "'Ж', '€'"),
        (["--prompt", "x", "--prompt-file", "p.txt"], "not both"),
        (["--prompt-file", "nope.txt"], "does not exist"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, run_dir, args, message) -> None:
    code, out, err = cli(capsys, "sample", "--checkpoint", str(run_dir), *args)
    assert code == 2
    assert message in err
    assert "Traceback" not in out + err


def test_broken_runs_exit_2(capsys, run_dir, tmp_path) -> None:
    import shutil

    def broken(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(run_dir, target)
        return target

    no_tok = broken("no_tok")
    (no_tok / "tokenizer.json").unlink()
    truncated = broken("truncated")
    for weights in ("model.safetensors", "best.safetensors"):
        data = (truncated / weights).read_bytes()
        (truncated / weights).write_bytes(data[: len(data) // 2])
    mismatch = broken("mismatch")
    CharTokenizer.train([TEXT + "XYZ"]).save(mismatch / "tokenizer.json")
    for d, message in [
        (no_tok, "no tokenizer.json"),
        (truncated, "truncated"),
        (mismatch, "tokens but the weights"),
        (tmp_path / "absent", "does not"),
    ]:
        code, out, err = cli(capsys, "sample", "--checkpoint", str(d), "--prompt", "R")
        assert code == 2, err
        assert message in err and "Traceback" not in out + err


@pytest.mark.slow
def test_ctrl_c_exits_130_without_traceback(tmp_path) -> None:
    # A tokenizer without an end-of-text token: the sample cannot end by itself before SIGINT.
    run_dir = make_run(tmp_path / "run", CharTokenizer(sorted(set(TEXT)), eot=None))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmcli",
            "sample",
            "--checkpoint",
            str(run_dir),
            "--max-new-tokens",
            "1000000",
            "--stream",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=default_sigint,
    )
    try:
        assert proc.stdout.read(1)  # generation has started
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert b"Traceback" not in err


def test_the_latest_run_is_named_with_its_step_and_an_unfinished_one_says_so(
    capsys, tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    done = make_run(tmp_path / "checkpoints" / "done", CharTokenizer.train([TEXT]))
    stopped = make_run(tmp_path / "checkpoints" / "stopped", CharTokenizer.train([TEXT]))
    for run, step in ((done, 300), (stopped, 115)):
        meta = json.loads((run / "meta.json").read_text())
        (run / "meta.json").write_text(json.dumps({**meta, "step": step, "max_steps": 300}))
    os.utime(done / "model.safetensors", (1, 1))
    code, _, err = cli(capsys, "sample", "--prompt", "ROMEO:", "--no-stream")
    assert code == 0
    stopped_at = Path("checkpoints") / "stopped"
    assert f"using the latest text run: {stopped_at}, at step 115 of 300 (unfinished)\n" in err
