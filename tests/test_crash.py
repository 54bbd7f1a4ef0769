"""Crash safety: no kill, full disk or Ctrl-C loses a run or prints a traceback.

- SIGKILL a real `llmcli train` process at three random moments (between saves, in the middle
  of writing a file of a save, and at a random wall-clock instant); after each, the run
  directory loads, every weights file and the resume state equal the uninterrupted run's weights
  at their step, and `--resume` ends with weights bitwise identical to the uninterrupted run.
- A write that fails with ENOSPC (simulated in the one function where bytes hit the disk) stops
  the run with exit status 2 and a clear message, leaves the previous checkpoint intact, and a
  later `--resume` still ends bitwise identical.
- SIGINT (a real signal, to this process) at a random moment of `train` saves and exits 130
  and the run resumes exactly; during `sample` and `inspect-attention` it exits 130 with no
  traceback. (Real `llmcli` processes get Ctrl-C in tests/test_train.py and
  tests/test_sample_cli.py.)

The moments are drawn from `random.Random` with a fixed seed, so a failure can be replayed.
Everything trains on one thread (here and in the subprocesses) so bitwise comparisons hold.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

import llmcli.data.token_cache
import llmcli.training.checkpoint
import llmcli.training.log
import llmcli.training.loop
from llmcli import fileio
from llmcli.cli import main
from llmcli.config import config_from_dict
from llmcli.runs.directory import STATE_FILE, save_checkpoint
from llmcli.runs.formats import load_state, read_weights
from llmcli.runs.loading import load_run
from llmcli.runs.metrics import read_metrics
from llmcli.training.loop import train

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("crash_child.py")  # the killable `llmcli` process
MAX_STEPS, EVAL_INTERVAL = 12, 4
SAVES = list(range(EVAL_INTERVAL, MAX_STEPS + 1, EVAL_INTERVAL))  # 4, 8, 12
VOLATILE = ("elapsed_s", "tok_per_s", "mfu")


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread) -> dict:
    """The config, and an uninterrupted run with a copy of its weights at every save."""
    root = tmp_path_factory.mktemp("crash")
    corpus = root / "corpus.txt"
    corpus.write_text(
        (ROOT / "data" / "shakespeare.txt").read_text(encoding="utf-8")[:5000], encoding="utf-8"
    )
    raw = {
        "model": {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 16},
        "data": {"path": str(corpus), "cache_dir": str(root / "cache")},
        "train": {
            "device": "cpu",
            "batch_size": 4,
            "max_steps": MAX_STEPS,
            "warmup_steps": 2,
            "eval_interval": EVAL_INTERVAL,
            "eval_steps": 1,
            "log_interval": 2,
            "seed": 11,
        },
    }
    config_path = root / "crash.yaml"
    config_path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    real_save = save_checkpoint

    def save(run_dir, model, state, meta, **kwargs):
        snapshots[meta["step"]] = {k: v.detach().clone() for k, v in state["model"].items()}
        real_save(run_dir, model, state, meta, **kwargs)

    with pytest.MonkeyPatch.context() as mp:  # one thread, as the killed processes run
        mp.setattr(llmcli.training.checkpoint, "save_checkpoint", save)
        mp.setattr(llmcli.training.log, "plot_losses", lambda *args: None)  # (not compared)
        train(config_from_dict(raw), out_dir=root / "reference", progress=False)
    assert sorted(snapshots) == SAVES
    return {
        "root": root,
        "config": config_path,
        "reference": root / "reference",
        "snapshots": snapshots,
    }


class Pool:
    """Processes running tests/crash_child.py, warmed up (imports done) ahead of use: a test
    hands one a job and it starts at once. `total` are started in all, at most `ahead` unused."""

    def __init__(self, folder: Path, total: int, ahead: int = 2) -> None:
        self.folder, self.total, self.ahead = folder, total, ahead
        self.procs: list[subprocess.Popen] = []
        self.used = 0
        self._fill()

    def _fill(self) -> None:
        while len(self.procs) < min(self.total, self.used + self.ahead):
            i = len(self.procs)
            environ = dict(
                os.environ,
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT),
                CRASH_JOB=str(self.folder / f"job-{i}.json"),
            )
            for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
                environ.pop(name, None)
            with open(self.folder / f"job-{i}.log", "w") as log:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(CHILD)],
                        cwd=self.folder,
                        env=environ,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )

    def start(self, argv: list[str], marker: Path, **env: str) -> Child:
        """Run `llmcli ARGV` in the next warm process, with CRASH_* settings `env`."""
        assert self.used < self.total, "the pool is used up: raise its total"
        i, self.used = self.used, self.used + 1
        self._fill()
        job = self.folder / f"job-{i}.json"
        tmp = job.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "argv": argv,
                    "cwd": str(marker.parent),
                    "env": {"CRASH_MARKER": str(marker), **env},
                }
            )
        )
        os.replace(tmp, job)
        return Child(self.procs[i], self.folder / f"job-{i}.log", marker)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@dataclass
class Child:
    proc: subprocess.Popen
    log: Path
    marker: Path

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def wait_for(self, path: Path, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"ended early ({self.proc.returncode}): {self.output()}")
            assert time.monotonic() < deadline, "timed out waiting for " + path.name
            time.sleep(0.01)

    def signal(self, sig: int) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=120)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    pool = Pool(tmp_path_factory.mktemp("pool"), total=3, ahead=3)  # the 3 kills
    yield pool
    pool.close()


def train_argv(setup: dict, run_dir: Path, *args: str) -> list[str]:
    return ["train", str(setup["config"]), "--out", str(run_dir), "--no-progress", *args]


def assert_matches_reference_at_its_step(setup: dict, run_dir: Path) -> int:
    """The run loads, and every file's weights are the uninterrupted run's at the file's step.

    Returns the step of the resume state.
    """
    for weights in ("best", "last"):
        load_run(run_dir, weights=weights)
    for name in ("model.safetensors", "best.safetensors"):
        tensors, metadata = read_weights(run_dir / name)
        expected = setup["snapshots"][int(metadata["step"])]
        for key, tensor in tensors.items():
            assert torch.equal(tensor, expected[key]), f"{name} step {metadata['step']}: {key}"
    state = load_state(run_dir / STATE_FILE)
    expected = setup["snapshots"][state["step"]]
    for key, tensor in state["model"].items():
        assert torch.equal(tensor, expected[key]), f"state.pt step {state['step']}: {key}"
    return state["step"]


def resume_in_process(setup: dict, run_dir: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(setup["config"]), "--out", str(run_dir), "--resume", "--no-progress"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 0, captured.err
    assert f"step {MAX_STEPS}/{MAX_STEPS}" in captured.out


def assert_same_as_reference(setup: dict, run_dir: Path) -> None:
    reference, got = (
        read_weights(d / "model.safetensors")[0] for d in (setup["reference"], run_dir)
    )
    assert reference.keys() == got.keys()
    for key in reference:
        assert torch.equal(reference[key], got[key]), f"{key} differs bitwise"

    def stable(d: Path) -> list[dict]:
        return [
            {k: v for k, v in r.items() if k not in VOLATILE}
            for r in read_metrics(d / "metrics.jsonl")
        ]

    assert stable(run_dir) == stable(setup["reference"])
    assert not [p for p in os.listdir(run_dir) if ".tmp-" in p]


# --- SIGKILL ---------------------------------------------------------------------------------


def test_sigkill_at_three_random_moments_then_resume_is_bitwise_exact(
    pool: Pool, setup: dict, tmp_path: Path, capsys
) -> None:
    # (`pool` first: its processes import while `setup` trains the reference.)
    rng = random.Random(20240607)
    run_dir = tmp_path / "run"

    # 1. Between two saves: at a random step after the first save.
    step = rng.randint(SAVES[0] + 1, SAVES[1] - 1)
    child = pool.start(train_argv(setup, run_dir), tmp_path / "kill1", CRASH_AT_STEP=str(step))
    child.wait_for(child.marker)
    assert child.signal(signal.SIGKILL) == -signal.SIGKILL
    assert assert_matches_reference_at_its_step(setup, run_dir) == SAVES[0]

    # 2. During a save: part-way through writing a random file of the next save.
    name = rng.choice(["model.safetensors", "meta.json", "state.pt", "loss.png"])
    fraction = rng.random()
    child = pool.start(
        train_argv(setup, run_dir, "--resume"),
        tmp_path / "kill2",
        CRASH_IN_WRITE=f"{name}:1:{fraction:.3f}",
    )
    child.wait_for(child.marker)
    assert any(".tmp-" in p for p in os.listdir(run_dir)), "not killed in the middle of a write"
    assert child.signal(signal.SIGKILL) == -signal.SIGKILL
    assert assert_matches_reference_at_its_step(setup, run_dir) == SAVES[0], (name, fraction)

    # 3. At a random instant of the next session (held at the last step if it gets there).
    delay = rng.uniform(0.0, 1.0)
    child = pool.start(
        train_argv(setup, run_dir, "--resume"), tmp_path / "kill3", CRASH_AT_STEP=str(MAX_STEPS)
    )
    child.wait_for(child.marker.with_suffix(".started"))
    time.sleep(delay)
    assert child.signal(signal.SIGKILL) == -signal.SIGKILL, child.output()
    assert assert_matches_reference_at_its_step(setup, run_dir) in SAVES[:-1]

    resume_in_process(setup, run_dir, capsys)
    assert_same_as_reference(setup, run_dir)


# --- a full disk -----------------------------------------------------------------------------


def disk_full_on(monkeypatch, name: str, nth: int) -> dict:
    """Make the `nth` write of `name` fail with ENOSPC after writing part of its bytes."""
    real = fileio._write_and_sync
    seen = {"n": 0, "failed": False}

    def write(path: Path, data: bytes) -> None:
        if path.name.startswith(f".{name}.tmp-"):
            seen["n"] += 1
            if seen["n"] == nth:
                seen["failed"] = True
                path.write_bytes(data[: len(data) // 3])
                raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(fileio, "_write_and_sync", write)
    return seen


def improvements(run_dir: Path) -> list[int]:
    """The evaluation steps whose val loss beat every earlier one (when best.safetensors is
    written)."""
    steps, best = [], float("inf")
    for r in read_metrics(run_dir / "metrics.jsonl"):
        if r.get("kind") == "eval" and r["val_loss"] < best:
            steps.append(r["step"])
            best = r["val_loss"]
    return steps


@pytest.mark.parametrize("name", ["model.safetensors", "best.safetensors", "state.pt"])
def test_a_full_disk_during_a_save_stops_cleanly_and_resume_is_exact(
    setup: dict, tmp_path: Path, capsys, monkeypatch, name: str
) -> None:
    # The second write of the file fails: the save of step 8 (for best.safetensors, the
    # second improvement of the val loss; the first if it improved only once).
    nth = 2 if name != "best.safetensors" or len(improvements(setup["reference"])) > 1 else 1
    seen = disk_full_on(monkeypatch, name, nth)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(setup["config"]), "--out", str(run_dir), "--no-progress"])
    captured = capsys.readouterr()
    assert seen["failed"]
    assert exit_info.value.code == 2 and "Traceback" not in captured.err
    message = " ".join(captured.err.split())
    match = re.search(
        r"error: could not save the checkpoint of step (\d+) in '.*': no space "
        r"left on device \(free some disk space\)\. The previous checkpoint "
        r"\((step (\d+)|none yet)\) is intact",
        message,
    )
    assert match, message
    assert int(match.group(1)) in SAVES
    assert not [p for p in os.listdir(run_dir) if ".tmp-" in p]
    if match.group(3) is None:  # nothing was saved before: nothing to resume
        assert not (run_dir / "state.pt").exists()
        return
    assert assert_matches_reference_at_its_step(setup, run_dir) == int(match.group(3))

    monkeypatch.undo()  # space is free again
    resume_in_process(setup, run_dir, capsys)
    assert_same_as_reference(setup, run_dir)


def test_a_full_disk_for_the_run_files_or_the_token_cache_is_a_clear_error(
    setup: dict, tmp_path: Path, capsys, monkeypatch
) -> None:
    args = ["train", str(setup["config"]), "--no-progress"]
    disk_full_on(monkeypatch, "config.yaml", 1)
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--out", str(tmp_path / "run")])
    err = " ".join(capsys.readouterr().err.split())
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "cannot write the run files in" in err and "no space left on device" in err
    monkeypatch.undo()

    real_open = open

    class Full:
        def __init__(self, fh) -> None:
            self.fh = fh

        def write(self, data) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.fh.close()

    # The token cache is written through llmcli.data.token_cache's own `open` of the temporary
    # file.
    def open_full(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        return Full(fh) if "w" in mode else fh

    monkeypatch.setattr(llmcli.data.token_cache, "open", open_full, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                *args,
                "--out",
                str(tmp_path / "run2"),
                "--set",
                f"data.cache_dir={tmp_path / 'cache'}",
            ]
        )
    err = " ".join(capsys.readouterr().err.split())
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "cannot write the token cache" in err and "no space left on device" in err
    assert not [p for p in (tmp_path / "cache" / "tokens").iterdir() if p.suffix == ".bin"]


# --- SIGINT ----------------------------------------------------------------------------------


def test_sigint_at_a_random_moment_of_train_saves_exits_130_and_resumes_exactly(
    setup: dict, tmp_path: Path, capsys, monkeypatch, ctrl_c_raises
) -> None:
    # A real SIGINT to this process from a timer thread, at a random instant after the first
    # step (the last step waits for it, so it always lands during training).
    delay = random.Random(77).uniform(0.0, 0.6)
    fired = threading.Event()

    def fire() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        fired.set()

    timer = threading.Timer(delay, fire)
    original = llmcli.training.loop.train

    def on_step(step: int) -> None:
        if not timer.is_alive() and not fired.is_set():
            timer.start()
        while step == MAX_STEPS and not fired.wait(0.01):
            pass

    monkeypatch.setattr(
        llmcli.training.loop,
        "train",
        lambda *args, **kwargs: original(*args, on_step=on_step, **kwargs),
    )
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(setup["config"]), "--out", str(run_dir), "--no-progress"])
    timer.join()
    err = capsys.readouterr().err
    assert exit_info.value.code == 130, err
    assert "Traceback" not in err and "--resume" in err
    stopped = int(re.search(r"stopped at step (\d+)", err).group(1))
    assert load_state(run_dir / STATE_FILE)["step"] == stopped
    load_run(run_dir)

    monkeypatch.undo()
    resume_in_process(setup, run_dir, capsys)
    assert_same_as_reference(setup, run_dir)


@pytest.mark.parametrize(
    ("args", "target"),
    [
        (
            ["sample", "--prompt", "ROMEO:", "--max-new-tokens", "50", "--no-stream"],
            "llmcli.generation.engine.sample_next",
        ),
        (
            ["inspect-attention", "--prompt", "ROMEO: But soft", "--out", "{tmp}/attention"],
            "llmcli.inspection.attention.plot_layers",
        ),
    ],
    ids=["sample", "inspect-attention"],
)
def test_sigint_during_sample_and_inspect_exits_130_without_traceback(
    setup: dict, tmp_path: Path, capsys, monkeypatch, ctrl_c_raises, args: list[str], target: str
) -> None:
    # A real SIGINT to this process in the middle of generating / of drawing the pictures.
    module_name, attr = target.rsplit(".", 1)
    module = importlib.import_module(module_name)
    real, calls = getattr(module, attr), []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 3 or attr == "plot_layers":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the KeyboardInterrupt comes first
            raise AssertionError("SIGINT was not delivered")
        return real(*a, **k)

    monkeypatch.setattr(module, attr, interrupted)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--checkpoint", str(setup["reference"])])
    captured = capsys.readouterr()
    assert exit_info.value.code == 130, captured.err
    assert "Traceback" not in captured.out + captured.err
    assert len(calls) == (1 if attr == "plot_layers" else 3)
