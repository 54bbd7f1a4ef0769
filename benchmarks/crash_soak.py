"""Crash soak: SIGKILL a real `llmcli train` at random moments, resume, and compare; prints JSON.

A tiny run (1 layer, width 16, context 16, `--steps` steps, a save every `--eval-interval`) is
trained once, uninterrupted, in this process, keeping a copy of its weights at every save: the
reference. Then `--kills` SIGKILLs land on real `llmcli train` processes, in chains of
`--chain` kills on one run directory: each process resumes what the previous one left
(`--resume` when a resume state exists, else `--overwrite`) and is killed at a random moment:

- "step": after a random step of the session;
- "write": part-way (a random fraction of the bytes written) through a random file of a save
  (model.safetensors, meta.json, state.pt, loss.png) or of the session start (config.yaml,
  tokenizer.json);
- "instant": at a random wall-clock instant after the session's first step (the session is held
  at its last step, so the kill always lands before it ends).

After each kill the run directory must load (`load_run` best and last, `load_state`), and every
weights file and the resume state must equal, bitwise, the reference's weights at their step.
After each chain, `llmcli train --resume` (in this process) finishes the run, whose final weights
and metrics must equal the reference's bitwise. Every process trains on one thread.

Output keys: kills, resumes (sessions started from a saved state, the finishing ones included),
mismatches (files or final runs that differ from the reference: must be 0), unloadable (kills
after which the run did not load: must be 0), moments (kills per kind), written_when_killed
(kills per file of the "write" kind), state_steps (the resume state's step after each kill),
wall_s.

Distributed mode (`--distributed N`): the same run trained by `torchrun --nproc_per_node=N
--max-restarts=K -m llmcli train CONFIG --resume auto`, saving every `--save-interval` steps.
In each chain, K times, once a new group of workers is up, a random worker is SIGKILLed after a
random delay (during start-up, data preparation, training or a save); torchrun restarts the
group, which resumes from the last save (or starts afresh before the first one). The finished
run's weights and metrics must equal, bitwise, those of the same command never killed. Output
keys: kills, restarts (killed worker groups that torchrun restarted), resumed (groups that
resumed from a save; the others were killed before the first save or before they resumed),
stuck_joins (ranks that gave up joining a restarted group after 45 s, which torchrun restarted
again), mismatches (must be 0), failed (torchrun runs that did not end with status 0), wall_s.

Usage: python benchmarks/crash_soak.py [--kills 20] [--chain 4] [--seed 0] [--steps 24]
       python benchmarks/crash_soak.py --distributed 2 [--kills 10] [--chain 5] [--steps 60]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The child is the crash tests' own: the real CLI, pausing (to be killed there) at a step or in
# the middle of a file write, as its job says.
CHILD = ROOT / "tests" / "crash_child.py"

SAVE_FILES = ["model.safetensors", "meta.json", "state.pt", "loss.png"]
START_FILES = ["config.yaml", "tokenizer.json"]
VOLATILE = ("elapsed_s", "tok_per_s")


def soak_config(work: Path, chars: int, **train: object) -> tuple[dict, Path]:
    """The soak's tiny run on the first `chars` characters of the bundled corpus: its raw config
    and the YAML file it is written to, both in `work`."""
    import yaml

    corpus = work / "corpus.txt"
    text = (ROOT / "data" / "shakespeare.txt").read_text(encoding="utf-8")[:chars]
    corpus.write_text(text, encoding="utf-8")
    raw = {
        "model": {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 16},
        "data": {"path": str(corpus), "cache_dir": str(work / "cache")},
        "train": {"device": "cpu", "batch_size": 4, "warmup_steps": 2, "eval_steps": 1}
        | {"log_interval": 2, "seed": 3, **train},
    }
    path = work / "soak.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return raw, path


def stable(run_dir: Path) -> list[dict]:
    """A run's metrics records without the measured times and speeds."""
    from llmcli.runs.metrics import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in records]


def differences(run_dir: Path, reference: Path) -> int:
    """0 when a finished run equals the reference bitwise; 1 each for its final weights and its
    metrics when they differ."""
    import torch

    from llmcli.runs.formats import read_weights

    final = read_weights(run_dir / "model.safetensors")[0]
    expected = read_weights(reference / "model.safetensors")[0]
    same = final.keys() == expected.keys() and all(
        torch.equal(final[k], expected[k]) for k in final
    )
    return (not same) + (stable(run_dir) != stable(reference))


class Pool:
    """`total` child processes, started `ahead` of use so that their imports overlap."""

    def __init__(self, folder: Path, total: int, ahead: int = 2) -> None:
        self.folder, self.total, self.ahead = folder, total, ahead
        self.procs: list[subprocess.Popen] = []
        self.used = 0
        self._fill()

    def _fill(self) -> None:
        while len(self.procs) < min(self.total, self.used + self.ahead):
            i = len(self.procs)
            env = dict(
                os.environ,
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT),
                CRASH_JOB=str(self.folder / f"job-{i}.json"),
            )
            for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
                env.pop(name, None)
            with open(self.folder / f"job-{i}.log", "w") as log:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(CHILD)],
                        cwd=self.folder,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )

    def take(self, job: dict) -> tuple[subprocess.Popen, Path]:
        """Hand `job` to the next warm child: (its process, its log)."""
        i, self.used = self.used, self.used + 1
        self._fill()
        env = {"CRASH_MARKER": job["marker"]}
        if job.get("at_step") is not None:
            env["CRASH_AT_STEP"] = str(job["at_step"])
        if job.get("in_write"):
            env["CRASH_IN_WRITE"] = ":".join(str(x) for x in job["in_write"])
        tmp = self.folder / f"job-{i}.tmp"
        cwd = str(Path(job["marker"]).parent)
        tmp.write_text(json.dumps({"argv": job["argv"], "env": env, "cwd": cwd}))
        os.replace(tmp, self.folder / f"job-{i}.json")
        return self.procs[i], self.folder / f"job-{i}.log"

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--chain", type=int, default=4, help="kills per run directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--eval-interval", type=int, default=4)
    parser.add_argument("--tmp", default=None, help="work folder (default: a new temp folder)")
    parser.add_argument(
        "--distributed", type=int, default=0, metavar="N", help="N torchrun workers per run"
    )
    parser.add_argument("--save-interval", type=int, default=3, help="distributed mode's")
    parser.add_argument(
        "--max-delay", type=float, default=15.0, help="distributed: seconds before a kill, at most"
    )
    args = parser.parse_args()
    if args.distributed:
        print(json.dumps(distributed_soak(args)))
        return

    import torch

    from llmcli.cli import main as cli_main
    from llmcli.config import config_from_dict
    from llmcli.errors import CheckpointError
    from llmcli.runs.directory import STATE_FILE
    from llmcli.runs.formats import load_state, read_weights
    from llmcli.runs.loading import load_run
    from llmcli.training import checkpoint, log  # where the loop's saves and plots are made
    from llmcli.training import loop as train_module

    torch.set_num_threads(1)  # the children too: bitwise comparisons need the same kernels
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    work = Path(args.tmp or tempfile.mkdtemp(prefix="llmcli-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    raw, config_path = soak_config(
        work, 6000, max_steps=args.steps, eval_interval=args.eval_interval
    )
    saves = [s for s in range(1, args.steps + 1) if s % args.eval_interval == 0 or s == args.steps]
    pool = Pool(work, total=args.kills)  # warming up while the reference trains

    # --- the reference, with its weights at every save --------------------------------------
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    real_save, real_plot = checkpoint.save_checkpoint, log.plot_losses

    def save(run_dir, model, state, meta, **kwargs):
        snapshots[meta["step"]] = {k: v.detach().clone() for k, v in state["model"].items()}
        real_save(run_dir, model, state, meta, **kwargs)

    checkpoint.save_checkpoint, log.plot_losses = save, lambda *a: None
    try:
        train_module.train(config_from_dict(raw), out_dir=work / "reference", progress=False)
    finally:
        checkpoint.save_checkpoint, log.plot_losses = real_save, real_plot
    assert sorted(snapshots) == saves, (sorted(snapshots), saves)

    def check(run_dir: Path) -> tuple[int, int | None, bool]:
        """(files that differ from the reference, resume state's step, loadable)."""
        bad, loadable = 0, True
        state_step = None
        if (run_dir / "state.pt").exists():
            try:
                state = load_state(run_dir / STATE_FILE)
                for weights in ("best", "last"):
                    load_run(run_dir, weights=weights)
            except CheckpointError:
                return 0, None, False
            state_step = int(state["step"])
            expected = snapshots[state_step]
            bad += any(not torch.equal(t, expected[k]) for k, t in state["model"].items())
        else:
            try:
                load_run(run_dir)
            except CheckpointError:
                pass  # nothing saved yet: refusing with a message is right
        for name in ("model.safetensors", "best.safetensors"):
            if (run_dir / name).exists():
                try:
                    tensors, metadata = read_weights(run_dir / name)
                except CheckpointError:
                    loadable = False
                    continue
                expected = snapshots[int(metadata["step"])]
                bad += any(not torch.equal(t, expected[k]) for k, t in tensors.items())
        return bad, state_step, loadable

    kills = resumes = mismatches = unloadable = 0
    moments: Counter[str] = Counter()
    written: Counter[str] = Counter()
    state_steps: list[int | None] = []
    chain = 0
    try:
        while kills < args.kills:
            chain += 1
            run_dir = work / f"run-{chain}"
            for _ in range(min(args.chain, args.kills - kills)):
                state_step = (
                    load_state(run_dir / STATE_FILE)["step"]
                    if (run_dir / "state.pt").exists()
                    else 0
                )
                resuming = state_step > 0
                left = [s for s in saves if s > state_step]
                kind = rng.choice(["step", "write", "instant"])
                marker = work / f"kill-{kills:03d}"
                job: dict = {
                    "marker": str(marker),
                    "argv": [
                        "train",
                        str(config_path),
                        "--out",
                        str(run_dir),
                        "--no-progress",
                        "--resume" if resuming else "--overwrite",
                    ],
                }
                if kind == "step":
                    job["at_step"] = rng.randint(state_step + 1, args.steps)
                elif kind == "write":
                    name = rng.choice(SAVE_FILES + START_FILES)
                    nth = 1 if name in START_FILES else rng.randint(1, len(left))
                    job["in_write"] = [name, nth, round(rng.random(), 3)]
                    written[name] += 1
                else:
                    job["at_step"] = args.steps
                proc, log = pool.take(job)
                wait = marker if kind != "instant" else marker.with_suffix(".started")
                deadline = time.monotonic() + 300
                while not wait.exists():
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"child ended or hung before its kill: {log.read_text()}")
                    time.sleep(0.01)
                if kind == "instant":
                    time.sleep(rng.uniform(0.0, 2.0))
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
                resumes += resuming
                moments[kind] += 1
                bad, step, loadable = check(run_dir)
                mismatches += bad
                unloadable += not loadable
                state_steps.append(step)

            # Finish the run and compare it with the reference.
            resuming = (run_dir / "state.pt").exists()
            resumes += resuming
            argv = [
                "train",
                str(config_path),
                "--out",
                str(run_dir),
                "--no-progress",
                "--resume" if resuming else "--overwrite",
            ]
            quiet = io.StringIO()
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                try:
                    cli_main(argv)
                except SystemExit as exc:
                    if exc.code != 0:
                        raise
            mismatches += differences(run_dir, work / "reference")
    finally:
        pool.close()

    print(
        json.dumps(
            {
                "kills": kills,
                "resumes": resumes,
                "mismatches": mismatches,
                "unloadable": unloadable,
                "chains": chain,
                "moments": dict(moments),
                "written_when_killed": dict(written),
                "state_steps": state_steps,
                "steps": args.steps,
                "saves": saves,
                "seed": args.seed,
                "wall_s": round(time.perf_counter() - t0, 1),
                "torch": torch.__version__,
                "python": sys.version.split()[0],
            }
        )
    )


def _workers(agent: int) -> list[int]:
    """The `llmcli` worker processes torchrun's agent (pid `agent`) started."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == agent and b"llmcli" in cmdline:
            pids.append(int(entry))
    return sorted(pids)


def distributed_soak(args: argparse.Namespace) -> dict:
    """Kill random torchrun workers at random moments; compare the finished runs bitwise."""

    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    work = Path(args.tmp or tempfile.mkdtemp(prefix="llmcli-dsoak-"))
    work.mkdir(parents=True, exist_ok=True)
    _, config = soak_config(
        work, 20000, max_steps=args.steps, eval_interval=20, save_interval=args.save_interval
    )
    # A rank stuck joining its group (a gloo hang) exits after 45 s: torchrun restarts it too.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), LLMCLI_DIST_JOIN_TIMEOUT="45")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(name, None)

    def torchrun(run_dir: Path, restarts: int, log: Path) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={args.distributed}", f"--max-restarts={restarts}"]
        cmd += ["-m", "llmcli", "train", str(config), "--out", str(run_dir)]
        cmd += ["--resume", "auto", "--no-progress"]
        with open(log, "w") as out:
            return subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)

    reference = work / "reference"
    if torchrun(reference, 0, work / "reference.log").wait() != 0:
        raise SystemExit(f"the reference run failed: {(work / 'reference.log').read_text()}")
    kills = restarts = resumed = mismatches = failed = chains = stuck_joins = 0
    while kills < args.kills:
        chains += 1
        run_dir, log = work / f"run-{chains}", work / f"run-{chains}.log"
        planned = min(args.chain, args.kills - kills)
        agent, seen = torchrun(run_dir, planned + 3, log), set()
        while agent.poll() is None and len(seen) < planned:
            group = _workers(agent.pid)
            if len(group) < args.distributed or seen & set(group):
                time.sleep(0.05)  # not up yet, or the group we killed not yet restarted
                continue
            time.sleep(rng.uniform(0.2, args.max_delay))
            if agent.poll() is not None:
                break
            victim = rng.choice(group)
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
            seen |= set(group)
            kills += 1
        failed += agent.wait() != 0
        text = log.read_text()
        restarts += text.count("(exitcode: -9)")  # each killed group, restarted by torchrun
        stuck_joins += text.count("could not join")
        resumed += text.count("resuming run")
        mismatches += differences(run_dir, reference)
    return {
        "mode": "distributed",
        "workers": args.distributed,
        "kills": kills,
        "restarts": restarts,
        "stuck_joins": stuck_joins,
        "resumed": resumed,
        "mismatches": mismatches,
        "failed": failed,
        "chains": chains,
        "steps": args.steps,
        "save_interval": args.save_interval,
        "seed": args.seed,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


if __name__ == "__main__":
    main()
