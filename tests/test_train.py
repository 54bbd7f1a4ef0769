"""The training loop (llmcli/training/loop.py) and `llmcli train`: metrics, evaluation, checkpoints,
exact resume after Ctrl-C and SIGKILL, divergence, write failures, bad input, and DDP.

Every run here is a 1-layer model of width 16 on 30k characters, trained on one thread (in this
process and in subprocesses alike) so that bitwise comparisons do not depend on thread count.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import default_sigint
from terminal_helpers import CTRL_C, Terminal

from llmcli import fileio
from llmcli.config import Config, config_from_dict, dump_yaml
from llmcli.device import usable_cpus
from llmcli.errors import CheckpointError, InputError
from llmcli.evaluation.probe import make_probe, probe_scores
from llmcli.runs.directory import STATE_FILE
from llmcli.runs.formats import load_state, read_weights
from llmcli.runs.head_metrics import read_head_metrics
from llmcli.runs.loading import load_run
from llmcli.runs.metrics import read_metrics
from llmcli.training.evaluate import EVAL_SEED_OFFSET
from llmcli.training.guard import DivergenceError
from llmcli.training.loop import train
from llmcli.training.optim import lr_at

ROOT = Path(__file__).resolve().parents[1]
PAUSING_CHILD = Path(__file__).with_name("pausing_child.py")  # `llmcli`, pausing at a step
VOLATILE = ("elapsed_s", "tok_per_s", "mfu")  # the only metrics allowed to differ between runs


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    text = (ROOT / "data" / "shakespeare.txt").read_text(encoding="utf-8")[:30_000]
    path.write_text(text, encoding="utf-8")
    return path


def make_config(corpus: Path, **train: object) -> Config:
    raw = {
        "model": {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 8},
        "data": {
            "path": str(corpus),
            "tokenizer": "char",
            "cache_dir": str(corpus.parent / "cache"),
        },
        "train": {
            "device": "cpu",
            "batch_size": 4,
            "max_steps": 30,
            "warmup_steps": 3,
            "eval_interval": 10,
            "eval_steps": 2,
            "log_interval": 5,
            "seed": 7,
            **train,
        },
    }
    return config_from_dict(raw, name="t")


def write_config(config: Config, path: Path) -> Path:
    path.write_text(dump_yaml(config), encoding="utf-8")
    return path


def weights(run_dir: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return read_weights(run_dir / name)[0]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), f"{name} differs bitwise"


def assert_close_weights(a: Path, b: Path, atol: float) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=atol, rtol=0, msg=name)


def stable_metrics(run_dir: Path) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k not in VOLATILE}
        for r in read_metrics(run_dir / "metrics.jsonl")
    ]


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    env.pop("WORLD_SIZE", None)
    return env


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmcli", *args],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory) -> Path:
    """An uninterrupted 30-step run (in this process), to compare resumed runs with."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(make_config(corpus), out_dir=run_dir, progress=False)
    finally:
        torch.set_num_threads(threads)
    return run_dir


# --- a run: files, metrics, evaluation -------------------------------------------------------


def test_a_run_writes_its_directory_metrics_and_evaluations(reference: Path, corpus: Path) -> None:
    from llmcli.data.batches import BatchSampler
    from llmcli.data.tokens import prepare_data

    names = set(os.listdir(reference))
    assert names == {
        "config.yaml",
        "tokenizer.json",
        "model.safetensors",
        "best.safetensors",
        "meta.json",
        "state.pt",
        "metrics.jsonl",
        "head_metrics.jsonl",
        "loss.png",
        ".llmcli.lock",  # the lock a run is written under (its holder's note goes with it)
    }
    assert (reference / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = make_config(corpus)
    records = read_metrics(reference / "metrics.jsonl")
    logs = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in logs] == [5, 10, 15, 20, 25, 30]
    assert [r["step"] for r in evals] == [10, 20, 30]
    for r in records:
        assert r["tokens"] == r["step"] * 4 * 8
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, config.train))
        assert math.isfinite(r["train_loss"])
    for r in evals:
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
    elapsed = [r["elapsed_s"] for r in records]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    vocab = load_run(reference).tokenizer.vocab_size
    assert evals[-1]["val_loss"] < min(evals[0]["val_loss"], math.log(vocab))  # it learns

    # The final evaluation equals the mean loss of the final weights over the eval batches.
    run = load_run(reference, weights="last")
    data = prepare_data(config.data, 8)
    for split, tokens in (("train", data.train), ("val", data.val)):
        sampler = BatchSampler(tokens, 4, 8, seed=7 + EVAL_SEED_OFFSET)
        with torch.no_grad():
            losses = [run.model(*sampler.next())[1].item() for _ in range(2)]
        key = "val_loss" if split == "val" else "train_loss"
        assert evals[-1][key] == pytest.approx(sum(losses) / 2, rel=1e-5)

    meta = json.loads((reference / "meta.json").read_text())
    assert meta["step"] == 30 and meta["tokens"] == 960
    assert meta["best_val_loss"] == min(r["val_loss"] for r in evals)
    assert load_state(reference / STATE_FILE)["best_step"] == meta["best_step"]
    if meta["best_step"] == 30:
        assert (reference / "best.safetensors").read_bytes() == (
            reference / "model.safetensors"
        ).read_bytes()


def test_evaluation_does_not_move_the_training_stream(
    reference: Path, corpus: Path, tmp_path: Path
) -> None:
    train(make_config(corpus, eval_interval=30), out_dir=tmp_path / "run", progress=False)
    assert_same_weights(reference, tmp_path / "run")


def test_head_metrics_equal_a_recomputation_from_the_saved_weights(
    reference: Path, corpus: Path
) -> None:
    from llmcli.data.batches import BatchSampler
    from llmcli.data.tokens import prepare_data

    evals = [r for r in read_metrics(reference / "metrics.jsonl") if r["kind"] == "eval"]
    grids = read_head_metrics(reference / "head_metrics.jsonl")
    assert [r["step"] for r in grids] == [r["step"] for r in evals] == [10, 20, 30]
    # The last evaluation's weights are the saved model.safetensors.
    run = load_run(reference, weights="last")
    probe = make_probe(run.tokenizer, 8)
    scores = probe_scores(run.model, probe)
    last, grid = evals[-1], grids[-1]
    assert last["induction_max"] == pytest.approx(scores.induction.max(), rel=1e-6)
    assert last["prev_token_max"] == pytest.approx(scores.prev_token.max(), rel=1e-6)
    assert grid["probe"] == probe.describe() and grid["tokens"] == last["tokens"]
    for name in ("prev_token", "induction", "duplicate_token"):
        np.testing.assert_allclose(grid[name], getattr(scores, name), rtol=1e-6)
        assert np.shape(grid[name]) == (1, 2)  # n_layer x n_head
    # The loss at each position of the same validation batches, by hand: with a context of 8,
    # the in-context learning score is the loss at position 7 (the last 10%) minus position 0
    # (around 10%).
    data = prepare_data(make_config(corpus).data, 8)
    sampler = BatchSampler(data.val, 4, 8, seed=7 + EVAL_SEED_OFFSET)
    nll = []
    with torch.no_grad():
        for _ in range(2):
            x, y = sampler.next()
            logp = torch.log_softmax(run.model(x)[0], -1)  # (B, T, V)
            nll.append(-logp.gather(-1, y[..., None])[..., 0])  # (B, T)
    by_position = torch.cat(nll).mean(0).tolist()
    np.testing.assert_allclose(grid["val_loss_by_position"], by_position, rtol=1e-5)
    assert last["icl_score"] == grid["icl_score"]
    assert last["icl_score"] == pytest.approx(by_position[7] - by_position[0], rel=1e-4)
    assert np.mean(by_position) == pytest.approx(last["val_loss"], rel=1e-5)


def test_head_metrics_off_writes_nothing_more_and_on_does_not_move_the_stream(
    reference: Path, corpus: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    train(make_config(corpus, head_metrics=False), out_dir=run_dir, progress=False)
    assert not (run_dir / "head_metrics.jsonl").exists()
    assert set(os.listdir(reference)) - set(os.listdir(run_dir)) == {"head_metrics.jsonl"}
    added = {"induction_max", "prev_token_max", "icl_score"}
    off = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
    assert off and not any(added & set(r) for r in off)
    on = [r for r in read_metrics(reference / "metrics.jsonl") if r["kind"] == "eval"]
    assert all(added <= set(r) for r in on)
    # The same weights and losses: scoring the heads touches no random number generator.
    assert_same_weights(reference, run_dir)
    assert [{k: r[k] for k in ("step", "val_loss")} for r in on] == [
        {k: r[k] for k in ("step", "val_loss")} for r in off
    ]


def test_gradient_accumulation_scales_the_loss(corpus: Path, tmp_path: Path) -> None:
    # Two micro-batches of 4 draw the same windows as one batch of 8 (one generator), so the
    # runs differ only by float rounding if the loss is divided by grad_accum.
    # (Evaluation batches have batch_size rows, so the val losses differ; train losses do not.)
    one = train(
        make_config(corpus, batch_size=8, max_steps=10, eval_interval=10),
        out_dir=tmp_path / "one",
        progress=False,
    )
    two = train(
        make_config(corpus, batch_size=4, grad_accum=2, max_steps=10, eval_interval=10),
        out_dir=tmp_path / "two",
        progress=False,
    )
    assert two.tokens == one.tokens == 10 * 8 * 8
    logged = [
        [
            r["train_loss"]
            for r in read_metrics(tmp_path / name / "metrics.jsonl")
            if r["kind"] == "train"
        ]
        for name in ("one", "two")
    ]
    assert logged[1] == pytest.approx(logged[0], abs=1e-5)
    assert_close_weights(tmp_path / "one", tmp_path / "two", atol=1e-6)


# --- exact resume ----------------------------------------------------------------------------


def test_ctrl_c_saves_and_resume_is_bitwise_exact(
    reference: Path, corpus: Path, tmp_path: Path, ctrl_c_raises
) -> None:
    run_dir = tmp_path / "run"

    def interrupt(step: int) -> None:
        if step == 13:
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        train(make_config(corpus), out_dir=run_dir, progress=False, on_step=interrupt)
    assert load_state(run_dir / STATE_FILE)["step"] == 13
    assert load_run(run_dir).step in (10, 13)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored

    # As if the run had gone on to write step 20's grids and died before saving it, mid-line.
    step_20 = (reference / "head_metrics.jsonl").read_bytes().splitlines(keepends=True)[1]
    with open(run_dir / "head_metrics.jsonl", "ab") as f:
        f.write(step_20 + b'{"step": 30, "induc')

    summary = train(make_config(corpus), out_dir=run_dir, resume=True, progress=False)
    assert summary.resumed_from == 13 and summary.step == 30
    assert_same_weights(reference, run_dir)
    assert stable_metrics(run_dir) == stable_metrics(reference)
    lines = (run_dir / "head_metrics.jsonl").read_bytes().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [10, 20, 30]  # each step once
    assert (run_dir / "head_metrics.jsonl").read_bytes() == (
        reference / "head_metrics.jsonl"
    ).read_bytes()
    elapsed = [r["elapsed_s"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert elapsed == sorted(elapsed)  # summed across the two sessions


def test_resume_refuses_another_model_shape_and_needs_a_saved_run(
    reference: Path, corpus: Path, tmp_path: Path
) -> None:
    config = make_config(corpus)
    config.model = dataclasses.replace(config.model, n_embed=32)
    with pytest.raises(CheckpointError, match=r"model\.n_embed: saved 16, config 32"):
        train(config, out_dir=reference, resume=True, progress=False)
    with pytest.raises(CheckpointError, match="nothing to resume"):
        train(make_config(corpus), out_dir=tmp_path / "empty", resume=True, progress=False)
    assert not (tmp_path / "empty").exists()
    with pytest.raises(CheckpointError, match="already holds a run"):
        train(make_config(corpus), out_dir=reference, progress=False)
    # A finished run resumed with the same config has nothing left to do.
    done = train(make_config(corpus), out_dir=reference, resume=True, progress=False)
    assert done.step == 30 and done.tokens_per_s is None


def cli(capsys, *args: object) -> tuple[int, str]:
    """Run `llmcli` in this process: (exit status, stderr on one line)."""
    from llmcli.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    return exc.value.code, " ".join(capsys.readouterr().err.split())


def test_a_folder_of_other_files_needs_overwrite_which_keeps_them(
    corpus: Path, tmp_path: Path, capsys
) -> None:
    config = write_config(make_config(corpus, max_steps=10), tmp_path / "t.yaml")
    out = tmp_path / "mine"
    (out / "photos").mkdir(parents=True)
    (out / "notes.txt").write_text("my notes")
    mine = ["notes.txt", "photos"]
    for where in (("--out", out), ("--set", f"train.out_dir={out}")):
        code, err = cli(capsys, "train", config, *where, "--no-progress")
        assert code == 2, err
        assert f"'{out}' is not empty and holds no llmcli run: it has notes.txt, photos/" in err
        assert "--overwrite" in err and "Traceback" not in err
        assert sorted(p.name for p in out.iterdir()) == mine  # nothing written
    code, err = cli(capsys, "train", config, "--out", out, "--resume", "auto", "--no-progress")
    assert code == 2 and "holds no llmcli run" in err  # nothing to resume: a fresh start

    code, err = cli(capsys, "train", config, "--out", out, "--overwrite", "--no-progress")
    assert code == 0, err
    assert load_run(out).step == 10 and (out / STATE_FILE).is_file()
    assert (out / "notes.txt").read_text() == "my notes" and (out / "photos").is_dir()

    # Now it holds a run: continued as any run is, and started afresh with the files kept.
    code, err = cli(capsys, "train", config, "--out", out, "--no-progress")
    assert code == 2 and "already holds a run (step 10)" in err
    code, err = cli(
        capsys, "train", config, "--out", out, "--resume", "--set", "train.max_steps=20"
    )
    assert code == 0, err
    assert load_state(out / STATE_FILE)["step"] == 20
    code, err = cli(capsys, "train", config, "--out", out, "--overwrite", "--no-progress")
    assert code == 0, err
    assert load_state(out / STATE_FILE)["step"] == 10
    assert (out / "notes.txt").read_text() == "my notes" and (out / "photos").is_dir()


def test_an_empty_folder_or_one_with_only_a_runs_files_starts_as_before(
    reference: Path, corpus: Path, tmp_path: Path
) -> None:
    config = make_config(corpus, max_steps=10)
    (tmp_path / "empty").mkdir()
    assert train(config, out_dir=tmp_path / "empty", progress=False).step == 10
    # A run killed before its first save: its first files and a temporary file of a write.
    killed = tmp_path / "killed"
    killed.mkdir()
    for name in ("config.yaml", "tokenizer.json", "metrics.jsonl"):
        (killed / name).write_bytes((reference / name).read_bytes())
    (killed / f".loss.png{fileio.TMP_MARK}123").write_bytes(b"half")
    assert train(config, out_dir=killed, progress=False).step == 10
    assert not list(killed.glob(fileio.TMP_GLOB))


def test_divergence_names_the_step_and_keeps_the_last_good_checkpoint(
    corpus: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    holder: dict = {}

    def poison(step: int) -> None:
        if step == 12:  # the loss of step 13 is the first one computed with a NaN weight
            with torch.no_grad():
                holder["model"].wte.weight[0, 0] = float("nan")

    import llmcli.training.build

    original = llmcli.training.build.Transformer

    def capture(*args, **kwargs):
        holder["model"] = original(*args, **kwargs)
        return holder["model"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llmcli.training.build, "Transformer", capture)
        with pytest.raises(DivergenceError) as info:
            # Without the spike guard (with it, tests/test_guard.py): today's stop.
            config = make_config(corpus, spike_guard=False)
            train(config, out_dir=run_dir, progress=False, on_step=poison)
    message = str(info.value)
    assert "nan at step 13" in message and "train.lr" in message and "step 10" in message
    assert load_state(run_dir / STATE_FILE)["step"] == 10
    run = load_run(run_dir)
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(
    corpus: Path, tmp_path: Path, monkeypatch
) -> None:
    run_dir = tmp_path / "run"
    real = fileio._write_and_sync
    saves = {"n": 0}

    def write(path: Path, data: bytes) -> None:
        if path.name.startswith(".state.pt"):
            saves["n"] += 1
        if saves["n"] >= 1 and not path.name.startswith(".state.pt"):
            path.write_bytes(data[: len(data) // 3])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(fileio, "_write_and_sync", write)
    with pytest.raises(CheckpointError) as info:
        train(make_config(corpus), out_dir=run_dir, progress=False)
    message = str(info.value)
    assert "step 20" in message and "no space left" in message and "(step 10) is intact" in message
    assert load_state(run_dir / STATE_FILE)["step"] == 10
    assert load_run(run_dir).step == 10
    assert not [p for p in os.listdir(run_dir) if ".tmp-" in p]


def test_a_corpus_too_small_for_the_context_is_bad_input(tmp_path: Path) -> None:
    corpus = tmp_path / "small.txt"
    corpus.write_text("tiny text\n" * 3)
    with pytest.raises(InputError, match="context_length"):
        train(make_config(corpus), out_dir=tmp_path / "run", progress=False)


# --- the command, in real processes ----------------------------------------------------------


def start_pausing(config: Path, run_dir: Path, marker: Path, at: int, *extra: str):
    return subprocess.Popen(
        [
            sys.executable,
            str(PAUSING_CHILD),
            "train",
            str(config),
            "--out",
            str(run_dir),
            "--no-progress",
            *extra,
        ],
        cwd=ROOT,
        env=cli_env(PAUSE_AT=str(at), PAUSE_MARKER=str(marker)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"process ended early: {proc.communicate()}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.slow
def test_sigkill_and_sigint_leave_a_run_that_resumes_bitwise_exactly(
    reference: Path, corpus: Path, tmp_path: Path
) -> None:
    config = write_config(make_config(corpus), tmp_path / "t.yaml")
    run_dir, marker = tmp_path / "run", tmp_path / "pause"

    # SIGKILL at step 17, between the saves of steps 10 and 20.
    proc = start_pausing(config, run_dir, marker, 17)
    wait_for(marker, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert load_state(run_dir / STATE_FILE)["step"] == 10
    assert load_run(run_dir).step == 10

    # Resume; Ctrl-C (SIGINT) at step 23 saves there and exits 130 with no traceback.
    marker.unlink()
    proc = start_pausing(config, run_dir, marker, 23, "--resume")
    wait_for(marker, proc)
    proc.send_signal(signal.SIGINT)
    marker.with_suffix(".go").write_text("")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "--resume" in stderr
    assert load_state(run_dir / STATE_FILE)["step"] == 23

    # Resume to the end: the same weights, bit for bit, and the same metrics.
    out = run_cli("train", str(config), "--out", str(run_dir), "--resume", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "step 30/30" in out.stdout
    assert_same_weights(reference, run_dir)
    assert stable_metrics(run_dir) == stable_metrics(reference)


def in_terminal(config: Path, run_dir: Path, marker: Path, at: int) -> Terminal:
    """`llmcli train` on an 80-column terminal, pausing after step `at` (see `start_pausing`)."""
    args = [sys.executable, str(PAUSING_CHILD), "train", str(config), "--out", str(run_dir)]
    env = cli_env(PAUSE_AT=str(at), PAUSE_MARKER=str(marker))
    return Terminal(args, columns=80, cwd=ROOT, env=env)


@pytest.mark.slow
def test_ctrl_c_on_a_terminal_saves_at_once_and_its_outcome_is_the_last_line(
    reference: Path, corpus: Path, tmp_path: Path
) -> None:
    config = write_config(make_config(corpus), tmp_path / "t.yaml")
    run_dir, marker = tmp_path / "run", tmp_path / "pause"
    term = in_terminal(config, run_dir, marker, 20)  # 20: an evaluation is due after it
    term.wait_for("steps 1..30")  # a status line wrapped at words, never mid-word
    term.wait_until(marker.exists)
    # Start-up lines a user can read: what and why, in words (the cache is the reference's).
    start = term.text()
    assert "30.0K tokens, from the token cache" in start and ".bin" not in start
    assert "train.compile" not in start and "strongest induction head" in start, start
    term.press(CTRL_C)
    term.wait_for("SIGINT: saving a checkpoint after this step (Ctrl-C again quits at once")
    marker.with_suffix(".go").write_text("")
    assert term.wait() == 130, term.lines()
    # At 80 columns the bar keeps its cells and shows whole fields (those that fit).
    [bar] = [line for line in term.lines() if line.startswith("train:")]
    assert len(bar) <= 80 and bar.endswith("]"), bar
    assert re.search(r"\| *20/30 \[", bar) and re.search(r"\|[█▏▎▍▌▋▊▉ ]{10,}\|", bar), bar
    assert re.search(r"loss=\d\.\d{4}, tok/s=[\d,]+[,\]]", bar), bar
    # The last words on screen are the outcome: no bar redrawn after them.
    assert term.text().endswith(
        f"stopped at step 20; the checkpoint in '{run_dir}' is saved: continue with the same "
        "command and --resume (or --resume auto)"
    ), term.lines()
    # Saved at once, before the evaluation due at step 20, which the resumed run makes first:
    # it then ends as the uninterrupted run did, records included.
    state = load_state(run_dir / STATE_FILE)
    assert state["step"] == 20 and state["eval_pending"] is True
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r] == [10]
    train(make_config(corpus), out_dir=run_dir, resume=True, progress=False)
    assert_same_weights(reference, run_dir)
    assert stable_metrics(run_dir) == stable_metrics(reference)


@pytest.mark.slow
def test_a_second_ctrl_c_quits_at_once_saying_what_it_keeps_and_loses(
    corpus: Path, tmp_path: Path
) -> None:
    config = write_config(make_config(corpus), tmp_path / "t.yaml")
    run_dir, marker = tmp_path / "run", tmp_path / "pause"
    term = in_terminal(config, run_dir, marker, 17)  # saved at step 10
    term.wait_until(marker.exists)
    term.press(CTRL_C)
    term.wait_for("Ctrl-C again quits at once, without saving")
    term.press(CTRL_C)
    assert term.wait() == 130, term.lines()
    assert term.text().endswith(
        f"quitting without saving: the checkpoint of step 10 in '{run_dir}' is kept (continue "
        "with --resume); steps 11-17 are lost"
    ), term.lines()
    assert load_state(run_dir / STATE_FILE)["step"] == 10


@pytest.mark.slow
def test_a_second_train_into_a_live_run_is_refused_and_the_first_ends_intact(
    reference: Path, corpus: Path, tmp_path: Path, capsys
) -> None:
    config = write_config(make_config(corpus), tmp_path / "t.yaml")
    run_dir, marker = tmp_path / "run", tmp_path / "pause"
    proc = start_pausing(config, run_dir, marker, 17)  # holds its run between two saves
    wait_for(marker, proc)
    try:
        before = sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.iterdir())
        for extra in ([], ["--overwrite"], ["--resume"]):
            status, err = cli(capsys, "train", config, "--out", run_dir, "--no-progress", *extra)
            assert status == 2, (extra, err)
            assert f"'{run_dir}' is being written by process {proc.pid} " in err, err
            assert "pausing_child.py train" in err and "--out DIR" in err
        # The refused starts touched nothing, not even the first run's temporary files.
        assert sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.iterdir()) == before
        # Readers need no claim: they read the last whole save (step 10).
        assert load_run(run_dir).step == 10
        status, err = cli(capsys, "info", "--checkpoint", run_dir, "--json")
        assert status == 0, err
        status, err = cli(
            capsys, "sample", "--checkpoint", run_dir, "--prompt", "the", "--max-new-tokens", 4
        )
        assert status == 0, err
    finally:
        marker.with_suffix(".go").write_text("")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert_same_weights(reference, run_dir)
    assert stable_metrics(run_dir) == stable_metrics(reference)
    # Its claim ended with it: the next start into the folder is a writer again.
    status, err = cli(capsys, "train", config, "--out", run_dir, "--resume", "--no-progress")
    assert status == 0, err


@pytest.mark.slow
def test_an_unwritable_run_directory_exits_2_with_a_message(corpus: Path, tmp_path: Path) -> None:
    # (The other bad inputs raise InputError in process, tested above; the CLI maps every
    # InputError to exit status 2.)
    config = write_config(make_config(corpus), tmp_path / "t.yaml")
    (tmp_path / "file").write_text("")
    out = run_cli("train", str(config), "--out", str(tmp_path / "file" / "run"))
    assert out.returncode == 2, out.stderr
    assert "cannot write to output directory" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_ddp_two_processes_match_one_process_with_the_union_of_their_batches(
    corpus: Path, tmp_path: Path, monkeypatch
) -> None:
    import llmcli.data.batches
    import llmcli.objectives.base

    steps = dict(max_steps=20, warmup_steps=2, eval_interval=20, log_interval=10, grad_accum=2)
    config = write_config(make_config(corpus, batch_size=4, **steps), tmp_path / "ddp.yaml")
    ddp_dir = tmp_path / "ddp"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "llmcli",
            "train",
            str(config),
            "--out",
            str(ddp_dir),
            "--no-progress",
            "--set",
            "train.logger=tensorboard",
        ],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(list((ddp_dir / "tensorboard").glob("events.*"))) == 1  # rank 0 logs alone

    # One process, batch 8: each batch is rank 0's 4 windows followed by rank 1's.
    Sampler = llmcli.data.batches.BatchSampler

    class Union:
        def __init__(
            self, tokens, batch_size, context_length, seed, rank=0, world_size=1, device="cpu"
        ):
            self.parts = [
                Sampler(
                    tokens,
                    batch_size // 2,
                    context_length,
                    seed,
                    rank=r,
                    world_size=2,
                    device=device,
                )
                for r in range(2)
            ]

        def next(self):
            xs, ys = zip(*(p.next() for p in self.parts), strict=True)
            return torch.cat(xs), torch.cat(ys)

        @property
        def tokens_drawn(self):
            return sum(p.tokens_drawn for p in self.parts)

        def state_dict(self):
            return {"parts": [p.state_dict() for p in self.parts]}

    monkeypatch.setattr(llmcli.objectives.base, "BatchSampler", Union)
    train(make_config(corpus, batch_size=8, **steps), out_dir=tmp_path / "one", progress=False)

    ddp, one = (
        read_metrics(ddp_dir / "metrics.jsonl"),
        read_metrics(tmp_path / "one" / "metrics.jsonl"),
    )
    assert [(r["kind"], r["step"], r["tokens"]) for r in ddp] == [
        (r["kind"], r["step"], r["tokens"]) for r in one
    ]
    assert ddp[-1]["step"] == 20 and ddp[-1]["tokens"] == 20 * 2 * 2 * 4 * 8
    for a, b in zip(ddp, one, strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-4)
        if a["kind"] == "train":  # the norm of the gradients averaged over the ranks
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        if a["kind"] == "eval":
            assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-4)
    assert_close_weights(ddp_dir, tmp_path / "one", atol=1e-5)
    state = load_state(ddp_dir / STATE_FILE)
    assert state["step"] == 20 and len(state["rng"]) == 2


def test_training_runs_on_train_threads_and_puts_the_count_back(small_corpus, tmp_path) -> None:
    from conftest import small_run_config

    from llmcli.training.loop import train

    before = torch.get_num_threads()
    seen: list[int] = []
    for threads in (2, 1, None):
        raw = small_run_config(small_corpus, max_steps=2, eval_steps=1, threads=threads)
        seen.clear()
        train(
            config_from_dict(raw),
            out_dir=tmp_path / f"t{threads}",
            progress=False,
            on_step=lambda _: seen.append(torch.get_num_threads()),
        )
        expected = before if threads is None else min(threads, usable_cpus())
        assert seen == [expected, expected]
        assert torch.get_num_threads() == before
    with pytest.raises(InputError, match=r"train.threads \(0\) must be a number of CPU threads"):
        config_from_dict(small_run_config(small_corpus, threads=0))
