"""Head ablation speed: every head's Δloss with the layer cache against the plain way.

    python benchmarks/ablation_speed.py [--batches 20] [--rounds 3] [--threads N]
                                        [--baseline REV [--no-ablation]]

The model is the `tiny` config's (4 layers x 4 heads, n_embed 128, context 64, batches of 12, the
bundled corpus's 83 characters), initialised with a fixed seed; the batches are random tokens
(speed does not depend on the weights or the text). Three ways to get every head's zero-ablation
Δloss on the same batches, timed in interleaved rounds so that a busy machine slows all alike:

- `full`: one full forward per head per batch (`ablation.head_deltas_full`);
- `cache_1`: the layer cache, one head per pass (`head_deltas(..., heads_per_pass=1)`);
- `cache`: the layer cache with a layer's heads batched (`head_deltas`, the default).

With `--baseline REV` it also times the model's forward without a mask (the path every other
command takes) against the model at git revision REV, interleaved, inference and a training
forward + backward, and checks that the two give the same logits bit for bit (`--no-ablation`
times only that). REV's model is built through its own constructor, which takes the sizes as
arguments: a revision before the modules were built from their config (e.g. 4558fb4).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from git_baseline import load_baseline

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.config import ModelConfig  # noqa: E402
from llmcli.inspection.ablation import head_batch, head_deltas, head_deltas_full  # noqa: E402
from llmcli.model.gpt import Transformer  # noqa: E402

TINY = {"n_layer": 4, "n_head": 4, "n_embed": 128, "context_length": 64}
VOCAB, BATCH = 83, 12


def tiny_model(seed: int = 0) -> torch.nn.Module:
    return Transformer(
        ModelConfig(**TINY), VOCAB, generator=torch.Generator().manual_seed(seed)
    ).eval()


def baseline_tiny_model(cls: type, seed: int = 0) -> torch.nn.Module:
    """The baseline revision's model, built through its own constructor (sizes as arguments)."""
    return cls(VOCAB, **TINY, generator=torch.Generator().manual_seed(seed)).eval()


def random_batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    T = TINY["context_length"]
    return [
        (
            torch.randint(VOCAB, (BATCH, T), generator=g),
            torch.randint(VOCAB, (BATCH, T), generator=g),
        )
        for _ in range(n)
    ]


def _median_ratio(a: list[float], b: list[float]) -> float:
    """The median of the per-round ratios a / b (each round slowed alike by a busy machine)."""
    return round(statistics.median(x / y for x, y in zip(a, b, strict=True)), 3)


def time_ablation(batches: list, rounds: int) -> dict:
    """Seconds per round of each way, and the per-round speed-ups of the cache over `full`."""
    model = tiny_model()
    ways = {
        "full": lambda: head_deltas_full(model, batches),
        "cache_1": lambda: head_deltas(model, batches, heads_per_pass=1),
        "cache": lambda: head_deltas(model, batches),
    }
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    results = {}
    for _ in range(rounds):
        for name, way in ways.items():
            t0 = time.perf_counter()
            results[name] = way()
            seconds[name].append(time.perf_counter() - t0)
    full = results["full"].delta["zero"]
    return {
        "seconds": {name: [round(s, 3) for s in v] for name, v in seconds.items()},
        "speedup_cache_vs_full": _median_ratio(seconds["full"], seconds["cache"]),
        "speedup_cache_1_vs_full": _median_ratio(seconds["full"], seconds["cache_1"]),
        "max_abs_delta_difference": float(abs(results["cache"].delta["zero"] - full).max()),
        "forwards_per_batch": {
            "full": TINY["n_layer"] * TINY["n_head"] + 1,
            "cache_blocks_rerun": TINY["n_head"] * sum(range(1, TINY["n_layer"] + 1)),
        },
        "heads_per_pass": head_batch(model, BATCH * TINY["context_length"]),
    }


def time_no_mask(rev: str, rounds: int, reps: int = 20) -> dict:
    """Forward (inference) and forward + backward (training) without a mask: today vs `rev`."""
    baseline = load_baseline(rev, ("model",))  # that revision's whole package
    models = {
        "today": tiny_model(),
        "baseline": baseline_tiny_model(baseline["model"].Transformer),
    }
    models["baseline"].load_state_dict(models["today"].state_dict())
    x, y = random_batches(1, seed=7)[0]
    with torch.no_grad():
        same = torch.equal(models["today"](x)[0], models["baseline"](x)[0])
    ms: dict[str, dict[str, list[float]]] = {k: {"infer": [], "train": []} for k in models}
    for _ in range(rounds):
        for name, model in models.items():
            with torch.no_grad():
                model(x)  # warm
                t0 = time.perf_counter()
                for _ in range(reps):
                    model(x)
                ms[name]["infer"].append((time.perf_counter() - t0) / reps * 1e3)
            model.train()
            t0 = time.perf_counter()
            for _ in range(reps):
                model(x, y)[1].backward()
            ms[name]["train"].append((time.perf_counter() - t0) / reps * 1e3)
            model.eval()
    ratio = {kind: _median_ratio(ms["today"][kind], ms["baseline"][kind]) for kind in ms["today"]}
    return {
        "baseline_rev": baseline["rev"],
        "logits_equal_bit_for_bit": same,
        "ms_median": {
            name: {kind: round(statistics.median(v), 2) for kind, v in d.items()}
            for name, d in ms.items()
        },
        "today_over_baseline_time": ratio,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--baseline", help="git revision whose model to time the no-mask path against"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--no-ablation", action="store_true", help="time only the no-mask path")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = {
        "benchmark": "ablation_speed",
        "machine": {
            "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_avg_start": [round(v, 2) for v in os.getloadavg()],
        },
        "model": {**TINY, "vocab_size": VOCAB, "batch_size": BATCH},
        "batches": args.batches,
        "rounds": args.rounds,
    }
    if not args.no_ablation:
        out["ablation"] = time_ablation(random_batches(args.batches), args.rounds)
    if args.baseline:
        out["no_mask"] = time_no_mask(args.baseline, args.rounds * 3)
    out["machine"]["load_avg_end"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
