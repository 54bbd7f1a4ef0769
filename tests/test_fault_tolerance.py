"""Fault tolerance: one command that starts or resumes, saves between evaluations, preemption.

- `--resume auto` starts in an empty folder and continues a saved run, bitwise equal to an
  uninterrupted run; a folder holding another model or a run without a resume state is refused.
- `train.save_interval` / `train.save_interval_s` write the resume state between evaluations, and
  resuming from such a save is exact.
- SIGTERM (a scheduler's preemption) saves and exits 143; under torchrun every rank stops at the
  same step, in one checkpoint.
- Under `torchrun --max-restarts`, a worker SIGKILLed mid-run is restarted with the group, which
  continues from the last save to the same weights, bit for bit, as a run never killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import default_sigint, small_run_config
from safetensors.torch import load_file

from llmcli.cli import main
from llmcli.config import config_from_dict
from llmcli.errors import CheckpointError, InputError
from llmcli.runs.directory import META_FILE, METRICS_FILE, MODEL_FILE, STATE_FILE
from llmcli.runs.formats import load_state
from llmcli.runs.metrics import read_metrics
from llmcli.training.distributed import join_timeout
from llmcli.training.interrupt import EXIT_TERMINATED, Preempted
from llmcli.training.loop import train

ROOT = Path(__file__).resolve().parents[1]
ELASTIC_CHILD = Path(__file__).with_name("elastic_child.py")
MAX_STEPS = 20
VOLATILE = ("elapsed_s", "tok_per_s", "mfu")

pytestmark = pytest.mark.usefixtures("one_thread")


def raw_config(corpus: Path, **train_opts) -> dict:
    return small_run_config(
        corpus,
        **({"max_steps": MAX_STEPS, "eval_interval": 10, "eval_steps": 1, "seed": 5} | train_opts),
    )


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / MODEL_FILE)


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def stable_metrics(run_dir: Path) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k not in VOLATILE}
        for r in read_metrics(run_dir / METRICS_FILE)
    ]


def crash_at(step: int):
    def on_step(s: int) -> None:
        if s == step:
            raise RuntimeError("simulated crash")

    return on_step


def saved_step(run_dir: Path) -> int:
    return load_state(run_dir / STATE_FILE)["step"]


@pytest.fixture(scope="module")
def reference(small_corpus: Path, tmp_path_factory, one_thread) -> Path:
    """An uninterrupted run, saving only at its evaluations."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    train(config_from_dict(raw_config(small_corpus)), out_dir=run_dir, progress=False)
    return run_dir


def test_resume_auto_starts_then_continues_exactly(small_corpus, reference, tmp_path) -> None:
    config = config_from_dict(raw_config(small_corpus))
    run = tmp_path / "run"
    with pytest.raises(RuntimeError):  # the first start: nothing to resume, so it starts
        train(config, out_dir=run, resume="auto", progress=False, on_step=crash_at(13))
    assert saved_step(run) == 10
    summary = train(config, out_dir=run, resume="auto", progress=False)  # the same command
    assert summary.resumed_from == 10 and summary.step == MAX_STEPS
    assert_same_weights(run, reference)
    assert stable_metrics(run) == stable_metrics(reference)
    again = train(config, out_dir=run, resume="auto", progress=False)  # finished: nothing to do
    assert again.step == MAX_STEPS and again.resumed_from == MAX_STEPS
    assert_same_weights(run, reference)


def test_resume_auto_refuses_what_it_cannot_continue(small_corpus, reference, tmp_path) -> None:
    raw = raw_config(small_corpus)
    raw["model"]["n_embed"] = 32
    other = config_from_dict(raw)
    with pytest.raises(CheckpointError, match="the config's model differs"):
        train(other, out_dir=reference, resume="auto", progress=False)

    weights_only = tmp_path / "weights-only"  # a run without its resume state
    weights_only.mkdir()
    (weights_only / MODEL_FILE).write_bytes((reference / MODEL_FILE).read_bytes())
    config = config_from_dict(raw_config(small_corpus))
    with pytest.raises(CheckpointError, match="already holds a run"):
        train(config, out_dir=weights_only, resume="auto", progress=False)
    with pytest.raises(InputError, match="contradict"):
        train(config, out_dir=tmp_path / "x", resume="auto", overwrite=True, progress=False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--resume", "auto", "--overwrite"], "--resume auto and --overwrite contradict"),
        (["--resume=later"], "--resume takes no value, or 'auto'"),
        (["--set", "train.save_interval=0"], "train.save_interval (0) must be positive"),
        (["--set", "train.save_interval_s=-5"], "train.save_interval_s (-5.0) must be positive"),
        (["--set", "train.resume=maybe"], "train.resume must be true or false or 'auto'"),
    ],
)
def test_bad_fault_tolerance_options_exit_2(small_corpus, tmp_path, capsys, argv, message) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw_config(small_corpus)))
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(config), "--out", str(tmp_path / "run"), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run" / STATE_FILE).exists()


def test_resume_auto_from_the_cli_and_the_config(small_corpus, reference, tmp_path, capsys) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw_config(small_corpus, resume="auto")))
    run = tmp_path / "run"
    for _ in range(2):  # train.resume: auto, twice: starts, then finds the run finished
        with pytest.raises(SystemExit) as exit_info:
            main(["train", str(config), "--out", str(run), "--no-progress"])
        assert exit_info.value.code == 0
    assert_same_weights(run, reference)
    with pytest.raises(SystemExit) as exit_info:  # `--resume auto` on the command line too
        main(["train", str(config), "--out", str(run), "--resume", "auto", "--no-progress"])
    assert exit_info.value.code == 0
    assert f"step {MAX_STEPS}/{MAX_STEPS}" in capsys.readouterr().out
    assert_same_weights(run, reference)
    # --overwrite starts afresh although the config says resume: auto (and trains again).
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(config), "--out", str(run), "--overwrite", "--no-progress"])
    assert exit_info.value.code == 0, capsys.readouterr().err
    assert "resumed" not in capsys.readouterr().out
    assert_same_weights(run, reference)


@pytest.mark.parametrize(
    ("opts", "crash", "saved"),
    [
        ({"save_interval": 3}, 17, 15),  # steps 3, 6, 9, 10 (eval), 12, 15
        ({"save_interval_s": 1e-9}, 17, 16),  # due at every log step: 2, 4, ..., 16
    ],
    ids=["steps", "seconds"],
)
def test_saves_between_evaluations_resume_exactly(
    small_corpus, reference, tmp_path, opts, crash, saved
) -> None:
    config = config_from_dict(raw_config(small_corpus, **opts))
    run = tmp_path / "run"
    with pytest.raises(RuntimeError):
        train(config, out_dir=run, progress=False, on_step=crash_at(crash))
    assert saved_step(run) == saved
    meta = json.loads((run / META_FILE).read_text())
    assert meta["step"] == saved and meta["best_step"] == 10  # saves without evaluations
    summary = train(config, out_dir=run, resume=True, progress=False)
    assert summary.saves == 2 and summary.save_s > 0  # steps 18 and 20
    assert_same_weights(run, reference)
    assert stable_metrics(run) == stable_metrics(reference)  # saving changes no record


def test_sigterm_saves_and_raises_preempted(small_corpus, reference, tmp_path) -> None:
    config = config_from_dict(raw_config(small_corpus))
    run = tmp_path / "run"

    def terminate(step: int) -> None:
        if step == 7:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Preempted):
        train(config, out_dir=run, progress=False, on_step=terminate)
    assert saved_step(run) == 7
    train(config, out_dir=run, resume=True, progress=False)
    assert_same_weights(run, reference)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", ""])
def test_a_bad_join_timeout_is_named(monkeypatch, value) -> None:
    monkeypatch.setenv("LLMCLI_DIST_JOIN_TIMEOUT", value)
    with pytest.raises(InputError, match="LLMCLI_DIST_JOIN_TIMEOUT=.*positive number"):
        join_timeout()


def test_the_join_timeout_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("LLMCLI_DIST_JOIN_TIMEOUT", raising=False)
    assert join_timeout() == 300.0
    monkeypatch.setenv("LLMCLI_DIST_JOIN_TIMEOUT", "45")
    assert join_timeout() == 45.0


# ---------------------------------------------------------------------------------------------
# Real processes: the CLI alone and under torchrun
# ---------------------------------------------------------------------------------------------


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(key, None)
    return env


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def wait_for_records(run_dir: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / METRICS_FILE).is_file() and read_metrics(run_dir / METRICS_FILE):
            return
        time.sleep(0.2)
    raise AssertionError(f"no training records in {run_dir} (exit status {proc.poll()})")


def terminate_when_training(cmd: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    try:
        wait_for_records(run_dir, proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.slow
def test_sigterm_to_the_cli_exits_143_with_a_checkpoint(small_corpus, tmp_path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(raw_config(small_corpus, max_steps=100_000, eval_interval=50_000))
    )
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "llmcli", "train", str(config), "--out", str(run)]
    out = terminate_when_training([*cmd, "--no-progress"], run)
    assert out.returncode == EXIT_TERMINATED, out.stderr[-2000:]
    assert "SIGTERM" in out.stderr and "Traceback" not in out.stderr
    step = saved_step(run)
    assert step > 0 and json.loads((run / META_FILE).read_text())["step"] == step


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_rank_at_one_step(small_corpus, tmp_path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(raw_config(small_corpus, max_steps=100_000, eval_interval=50_000))
    )
    run = tmp_path / "run"
    cmd = [*torchrun(), "-m", "llmcli", "train", str(config), "--out", str(run), "--no-progress"]
    out = terminate_when_training(cmd, run)
    assert out.returncode != 0  # torchrun reports the signal it got
    assert out.stderr.count("SIGTERM: saving a checkpoint") == 2, out.stderr[-3000:]
    assert "stopped at step" in out.stderr
    state = load_state(run / STATE_FILE)
    step = state["step"]
    assert step > 0 and json.loads((run / META_FILE).read_text())["step"] == step
    # One save of one step: each rank's sampler had drawn exactly `step` batches.
    assert [s["batches"] for s in state["sampler"]] == [step, step]
    assert torch.equal(load_file(run / MODEL_FILE)["wte.weight"], state["model"]["wte.weight"])


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_ends_bitwise_equal(
    small_corpus, tmp_path
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw_config(small_corpus)))
    runs = {}
    for name, kill_at in (("uninterrupted", "0"), ("killed", "14")):
        runs[name] = tmp_path / name
        cmd = [
            *torchrun(),
            "--max-restarts=3",  # the kill's restart, and room for a stuck join (below)
            str(ELASTIC_CHILD),
            "train",
            str(config),
            "--out",
            str(runs[name]),
            "--resume",
            "auto",
            "--no-progress",
        ]
        out = subprocess.run(
            cmd,
            cwd=ROOT,
            # Gloo can hang while a restarted group connects: such a rank exits after 45 s and
            # torchrun starts the group again (llmcli.training.distributed.join_timeout).
            env=cli_env(KILL_AT_STEP=kill_at, LLMCLI_DIST_JOIN_TIMEOUT="45"),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        if name == "killed":  # rank 1 died after step 14; the group resumed from step 10
            assert "exitcode: -9" in out.stderr and "steps 11..20" in out.stderr
            # The restarted rank 0 took the run directory's claim again: not refused.
            assert "is being written by" not in out.stderr
    assert_same_weights(runs["killed"], runs["uninterrupted"])
    assert stable_metrics(runs["killed"]) == stable_metrics(runs["uninterrupted"])
