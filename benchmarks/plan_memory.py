"""`llmcli plan`'s memory estimate against the measured peak of real training steps.

    python benchmarks/plan_memory.py [--cases tiny:12,tiny:48,small:8,small:16] [--device cpu]
        [--steps 2] [--set KEY=VALUE ...]

Each case (a shipped config at a micro-batch) runs in a fresh Python process, which builds the
config's model and optimizer exactly as `llmcli train` does (`Transformer`, `build_optimizer`,
`Precision`) and trains `--steps` steps of the loop's own step (`llmcli.training.step.train_step`
on a `Trainer`: `train.grad_accum` micro-batches, autocast, backward, clip, optimizer step) on
random tokens of the config's vocabulary. What is measured as the peak:

- on the CPU, the process's peak resident set size (`ru_maxrss`, what the kernel counts and what
  runs a laptop out of memory) minus the resident set size just before the model is built (after
  importing torch and making the batch): the weights, gradients, optimizer state, activations,
  temporaries of the backward pass, and the allocator's and oneDNN's own memory, all of it;
- on CUDA, `torch.cuda.max_memory_allocated` minus the memory allocated before the model is
  built (the tensors torch's caching allocator hands out, as `torch.cuda` reports them).

The estimate is `llmcli.training.memory.estimate_memory(...).peak` for the same config, device,
precision and micro-batch, the figure `llmcli plan` prints. `ratio` is estimate / measured; the
target is within 25% (0.75 to 1.25). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_CASES = "tiny:12,tiny:48,small:8,small:16"


def measure_case(name: str, batch: int, device_name: str, steps: int, sets: list[str]) -> dict:
    """In this (fresh) process: the measured peak of `steps` training steps and the estimate."""
    import torch

    from llmcli.config import load_config
    from llmcli.device import resolve_device
    from llmcli.model.gpt import Transformer
    from llmcli.training.memory import estimate_memory
    from llmcli.training.optim import build_optimizer
    from llmcli.training.plan import plan_vocab
    from llmcli.training.precision import Precision
    from llmcli.training.step import Trainer, train_step

    config = load_config(name, [*sets, f"train.batch_size={batch}"])
    tc, T = config.train, config.model.context_length
    device = resolve_device(device_name)
    precision = Precision.resolve(device, tc.dtype)
    vocab, _ = plan_vocab(config)
    gen = torch.Generator().manual_seed(tc.seed)
    micro_batches = steps * tc.grad_accum
    tokens = torch.randint(0, vocab, (micro_batches, batch, T + 1), generator=gen).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = _rss_bytes()

    model = Transformer(config.model, vocab, generator=gen).to(device)
    optimizer = build_optimizer(model, tc, device.type)
    batches = RandomBatches(tokens)
    trainer = Trainer(
        model, list(model.parameters()), optimizer, precision, batches, tc.grad_accum, tc.grad_clip
    )
    for _ in range(steps):
        train_step(trainer)

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        measured = torch.cuda.max_memory_allocated(device) - before
        how = "cuda_max_memory_allocated"
    else:
        measured = _peak_rss_bytes() - before
        how = "cpu_peak_rss_growth"
    estimate = estimate_memory(config, vocab, device.type, precision.name)
    return {
        "config": name,
        "batch_size": batch,
        "context_length": T,
        "dropout": config.model.dropout,
        "vocab_size": vocab,
        "device": str(device),
        "dtype": precision.name,
        "params": estimate.params,
        "estimate": {**estimate.as_dict(), "runtime": estimate.runtime},
        "measured_peak": measured,
        "measured_how": how,
        "ratio": round(estimate.peak / measured, 3),
        "within_25pct": abs(estimate.peak / measured - 1) <= 0.25,
    }


class RandomBatches:
    """A training stream over `tokens` `(N, B, T + 1)`: `next()` gives the next `(x, y)`."""

    def __init__(self, tokens: Tensor) -> None:
        self.tokens, self.i = tokens, 0

    def next(self) -> tuple[Tensor, Tensor]:
        row = self.tokens[self.i]  # (B, T + 1)
        self.i += 1
        return row[:, :-1], row[:, 1:]  # (B, T), (B, T)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DEFAULT_CASES, help="config:batch, comma-separated")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--steps", type=int, default=2, help="training steps per case")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="--set KEY=VAL")
    parser.add_argument("--case", nargs=2, metavar=("CONFIG", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:  # the child: one case, one JSON line
        name, batch = args.case[0], int(args.case[1])
        print(json.dumps(measure_case(name, batch, args.device, args.steps, args.sets)))
        return
    results = []
    for case in args.cases.split(","):
        name, batch = case.split(":")
        sets = [a for s in args.sets for a in ("--set", s)]
        command = [sys.executable, __file__, "--case", name, batch, "--device", args.device]
        command += ["--steps", str(args.steps), *sets]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), file=sys.stderr)
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "cases": results,
        "ratios": [r["ratio"] for r in results],
        "all_within_25pct": all(r["within_25pct"] for r in results),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
