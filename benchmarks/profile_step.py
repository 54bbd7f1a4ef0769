"""Where a CPU training step's time goes, against the matmul peak measured in the same run; JSON.

For each shape (the tiny config's, and the small one of train_throughput.py), the step that
`llmcli.training.loop` runs (llmcli's model, `build_optimizer`'s fused AdamW, loss kept on the
device, clipping with `foreach`: train_throughput.py's `llmcli_step`) runs under
`torch.profiler`, and every operator's self CPU time is put in one of these categories:

| category | operators |
| --- | --- |
| gemm | `mm`, `addmm`, `bmm`, `matmul`, `linear` and their backward (the linear layers, the head) |
| attention | `scaled_dot_product_attention` and the flash-attention kernels, forward and backward |
| norm | `layer_norm`, `rms_norm` and their backward |
| activation | `gelu`, `relu`, `silu` and their backward |
| optimizer | the fused AdamW step, `_foreach_*` (clipping), `zero_` |
| loss | `cross_entropy`, `log_softmax`, `nll_loss` and their backward |
| embedding | `embedding` and its backward (the token and position tables) |
| other kernels | every other operator (adds, copies, views, `cat`, reductions) |
| python | the step's wall time the operators do not account for: the interpreter, autograd's |
| | bookkeeping and dispatch between the kernels |

The shares are of the profiled steps' wall time. Beside them: the step's model GFLOP/s
(nanoGPT's 6 N + 12 L T C per token), the best fp32 GFLOP/s of square 512, 1024 and 2048
matmuls (the peak), and of the step's own GEMM shapes replayed alone on fresh operands, both
measured in the same run just before, and the step's fraction of each. The data (drawing
batches from the token file) is measured apart: the seconds `BatchSampler.next` takes per step
on the bundled corpus.

Usage: python benchmarks/profile_step.py [--steps 20] [--threads N] [--shapes tiny,small]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from train_throughput import (  # noqa: E402
    CONFIGS,
    VOCAB,
    batches,
    flops_per_token,
    gemm_seconds,
    llmcli_step,
    matmul_gflops,
    step_gemms,
)

from llmcli.data.batches import BatchSampler  # noqa: E402

SHAPES = {"tiny": CONFIGS["tiny"], "small": CONFIGS["6L_384_ctx256"]}
PEAK_SIZES = (512, 1024, 2048)  # the peak: the best of these square fp32 matmuls, 5 tries each
CATEGORIES = {
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
    "attention": ("scaled_dot_product", "flash_attention", "_efficient_attention"),
    "norm": ("layer_norm", "rms_norm"),
    "activation": ("gelu", "relu", "silu"),
    "optimizer": ("adam", "_foreach_", "aten::zero_"),
    "loss": ("cross_entropy", "log_softmax", "nll_loss"),
    "embedding": ("embedding",),
}


def category(op: str) -> str:
    """The category of an operator's name (`aten::addmm`; an autograd node, `MmBackward0`, by
    its forward's name), underscores and case aside."""
    name = op.lower().replace("_", "")
    for suffix in ("backward0", "backward1"):
        if name.endswith(suffix):
            name = "aten::" + name.removesuffix(suffix)
    for cat, needles in CATEGORIES.items():
        if any(needle.replace("_", "") in name for needle in needles):
            return cat
    return "other kernels"


def profile(shape: dict, steps: int) -> tuple[dict[str, float], float]:
    """Seconds per step by category (`python`: the wall time no operator accounts for) and the
    wall seconds per step, over `steps` profiled steps after three warm-up steps."""
    step, _ = llmcli_step(shape)
    data = batches(shape)
    for i in range(3):
        step(*data[i % len(data)])
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for i in range(steps):
            step(*data[i % len(data)])
        wall = time.perf_counter() - start
    seconds: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        seconds[category(event.key)] += event.self_cpu_time_total / 1e6
    # Under the profiler every operator costs a little more: the shares are what is comparable.
    accounted = sum(seconds.values())
    seconds["python"] = max(wall - accounted, 0.0)
    return {k: v / steps for k, v in seconds.items()}, wall / steps


def plain_step_seconds(shape: dict, steps: int, rounds: int = 3) -> float:
    """Median seconds per step without the profiler (its own cost left out)."""
    step, _ = llmcli_step(shape)
    data = batches(shape)
    for i in range(3):
        step(*data[i % len(data)])
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(steps):
            step(*data[i % len(data)])
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


def data_seconds(shape: dict, steps: int) -> float:
    """Seconds `BatchSampler.next` takes per step, on the bundled corpus's bytes as tokens."""
    text = (ROOT / "data" / "tinyshakespeare.txt").read_bytes()
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.uint16) % VOCAB
    sampler = BatchSampler(tokens, shape["batch_size"], shape["context_length"], seed=0)
    start = time.perf_counter()
    for _ in range(steps):
        sampler.next()
    return (time.perf_counter() - start) / steps


def measure(name: str, shape: dict, steps: int) -> dict:
    gemms = step_gemms(shape)
    gemm_seconds(gemms)  # warm-up
    gemm_floor = min(gemm_seconds(gemms) for _ in range(3))
    gemm_flops = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in gemms)
    peak = max(matmul_gflops(n, reps=5) for n in PEAK_SIZES)
    by_category, profiled_wall = profile(shape, steps)
    step_s = plain_step_seconds(shape, steps)
    model = llmcli_step(shape)[1]
    tokens = shape["batch_size"] * shape["context_length"]
    model_gflops = flops_per_token(model, shape) * tokens / step_s / 1e9
    total = sum(by_category.values())
    return {
        "shape": shape,
        "step_ms": round(step_s * 1e3, 2),
        "tokens_per_s": round(tokens / step_s),
        "model_gflops": round(model_gflops, 1),
        "matmul_peak_gflops": round(peak, 1),
        "step_gemm_gflops": round(gemm_flops / gemm_floor / 1e9, 1),
        "fraction_of_matmul_peak": round(model_gflops / peak, 3),
        "fraction_of_step_gemms": round(model_gflops / (gemm_flops / gemm_floor / 1e9), 3),
        "profiled_step_ms": round(profiled_wall * 1e3, 2),
        "shares": {k: round(v / total, 3) for k, v in sorted(by_category.items())},
        "data_ms_per_step": round(data_seconds(shape, steps) * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--shapes", default="tiny,small")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {name: measure(name, SHAPES[name], args.steps) for name in args.shapes.split(",")}
    out = {
        "benchmark": "profile_step",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": {
            "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "steps": args.steps,
        "results": results,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
