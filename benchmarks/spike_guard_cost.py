"""What `train.spike_guard` costs: the training step with the guard against the step without it.

    OMP_NUM_THREADS=1 python benchmarks/spike_guard_cost.py [--config tiny] [--rounds 10]
        [--steps 20] [--threads N] [--device cpu]

With the guard, every step reads its loss and gradient norm from the device (one `tolist()` of
two numbers; on the CPU, where the step has already run, nothing waits) and the guard checks them
against the median of its window (a sort of `spike_window` floats), before the optimizer step.
This builds the config's run (its corpus, model and optimizer, in a temporary folder) and times
the loop's own step (`llmcli.training.step.train_step`: forward, backward, clip, optimizer
step), without the guard and with the guard as the step's `before_update`
(`llmcli.training.guard.SpikeGuard`), in interleaved rounds (the order alternating) so that a
busy machine slows both alike:

- `step_off_s` / `step_on_s`: the median step time of each (the median over the rounds of each
  round's median), and `cost_step`, the median over the rounds of on / off - 1: a whole-step
  comparison, whose noise on a shared machine is larger than the guard's work;
- `guard_work_s`: the guard's own work alone (the read of the two numbers and `check`), timed
  over many repetitions on the step's tensors, and `cost_work` = guard_work / step_off: the
  figure the default is decided on (on by default if under 1%).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.config import load_config  # noqa: E402
from llmcli.device import resolve_device  # noqa: E402
from llmcli.training.build import build_run  # noqa: E402
from llmcli.training.counters import TrainState  # noqa: E402
from llmcli.training.distributed import DistInfo  # noqa: E402
from llmcli.training.guard import SpikeGuard  # noqa: E402
from llmcli.training.precision import Precision  # noqa: E402
from llmcli.training.step import train_step  # noqa: E402


def timed_steps(trainer, guard: SpikeGuard | None, n: int) -> float:
    """The median time of `n` steps of the loop (with `guard` as their `before_update`)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        train_step(trainer, guard)
        if trainer.precision.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def guard_work(config, device: torch.device, reps: int) -> float:
    """The median time of the guard's per-step work, on tensors like the step's."""
    guard = SpikeGuard(config.train, TrainState())
    loss = torch.tensor(2.0, device=device)
    norm = torch.tensor(0.5, device=device)
    times = []
    for i in range(reps):
        guard.counters.step = i
        start = time.perf_counter()
        guard(loss, norm)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20, help="steps per mode per round")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(args.config, [f"train.device={args.device}"])
    device = resolve_device(config.train.device, 0)
    precision = Precision.resolve(device, config.train.dtype)
    with tempfile.TemporaryDirectory() as folder:
        run = build_run(
            config, DistInfo(), precision, Path(folder) / "run", False, True, time.perf_counter()
        )
        guard = run.guard or SpikeGuard(config.train, run.state)
        timed_steps(run.trainer, None, 3)  # warm-up
        times: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(args.rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                on = guard if mode == "on" else None
                times[mode].append(timed_steps(run.trainer, on, args.steps))
        work = guard_work(config, device, 20_000)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    ratios = [b / a - 1 for a, b in zip(times["off"], times["on"], strict=True)]
    print(
        json.dumps(
            {
                "config": args.config,
                "device": str(device),
                "spike_window": config.train.spike_window,
                "step_off_s": round(off, 6),
                "step_on_s": round(on, 6),
                "cost_step": round(statistics.median(ratios), 5),
                "cost_step_rounds": [round(x, 4) for x in ratios],
                "guard_work_s": round(work, 8),
                "cost_work": round(work / off, 6),
                "skipped": guard.state.skips,
                "rounds": args.rounds,
                "steps_per_round": args.steps,
                "threads": torch.get_num_threads(),
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
