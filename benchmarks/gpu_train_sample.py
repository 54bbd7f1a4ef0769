"""The one-shot GPU check: train a config for a few hundred steps, then sample; prints JSON.

Meant for a machine with a CUDA GPU (run once, as one prepared script):
`llmcli.training.loop.train` on `configs/small.yaml` (bf16 autocast, fused AdamW, SDPA, with
`--compile` torch.compile), then `llmcli.generation.sample.sample_run` on the run it wrote.
Reported: training tokens/s (median over the log intervals after the first, which holds the warm-up
and any compilation), model FLOPs utilisation against `--peak-tflops` (nanoGPT's `6 N + 12 L T C`
FLOPs per token), the validation loss reached, and sampling tokens/s (KV cache, batch 1).

Runs on the CPU too (for a dry run, shrink it: `--set train.batch_size=4 --steps 20`).

Usage: python benchmarks/gpu_train_sample.py [--config configs/small.yaml] [--steps 300]
       [--compile] [--peak-tflops 790] [--out DIR] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmcli.config import load_config  # noqa: E402
from llmcli.generation.sample import sample_run  # noqa: E402
from llmcli.model.gpt import Transformer  # noqa: E402
from llmcli.runs.directory import METRICS_FILE  # noqa: E402
from llmcli.runs.metrics import read_metrics  # noqa: E402
from llmcli.training.loop import train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/small.yaml")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--compile", action="store_true", help="train with torch.compile")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=790.0,
        help="the device's dense peak for the training precision (H200 bf16)",
    )
    parser.add_argument("--sample-tokens", type=int, default=500)
    parser.add_argument("--out", default=None, help="run directory (default: a temp folder)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, as for llmcli train",
    )
    args = parser.parse_args()

    steps = args.steps
    overrides = [
        f"train.max_steps={steps}",
        f"train.eval_interval={steps}",
        f"train.log_interval={max(1, min(25, steps // 4))}",
        f"train.warmup_steps={min(100, steps // 3)}",
        f"train.compile={'true' if args.compile else 'false'}",
        *args.overrides,
    ]
    config = load_config(args.config, overrides)
    out = Path(args.out or tempfile.mkdtemp(prefix="llmcli-gpu-"))

    started = time.perf_counter()
    summary = train(config, out_dir=out, overwrite=True, progress=False)
    train_s = time.perf_counter() - started
    rates = [r["tok_per_s"] for r in read_metrics(out / METRICS_FILE) if r.get("kind") == "train"]
    steady = statistics.median(rates[1:] or rates)

    mc = config.model
    with torch.device("meta"):
        model = Transformer(mc, _vocab_size(out))
    n = model.num_parameters(non_embedding=True)
    flops_per_token = 6 * n + 12 * mc.n_layer * mc.context_length * mc.n_embed
    mfu = steady * flops_per_token / (args.peak_tflops * 1e12)

    settings = {"max_new_tokens": args.sample_tokens, "temperature": 0.8, "seed": 0}
    samples = sample_run(out, [""], settings, notify=lambda _: None)
    device = summary.device
    result = {
        "train": {
            "config": args.config,
            "overrides": overrides,
            "steps": summary.step,
            "device": device,
            "dtype": summary.dtype,
            "compile": args.compile,
            "tokens_per_s_median": round(steady, 1),
            "tokens_per_s_intervals": rates,
            "flops_per_token": flops_per_token,
            "mfu": float(f"{mfu:.4g}"),
            "peak_tflops_assumed": args.peak_tflops,
            "val_loss": summary.val_loss,
            "wall_s": round(train_s, 1),
        },
        "sample": {
            "new_tokens": samples[0].tokens,
            "tokens_per_s": round(samples[0].tokens_per_s, 1),
            "text_head": samples[0].completion[:200],
        },
        "machine": {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        },
        "run_dir": str(out),
    }
    print(json.dumps(result, indent=1))


def _vocab_size(run_dir: Path) -> int:
    from llmcli.runs.loading import load_tokenizer_file

    return int(load_tokenizer_file(run_dir).vocab_size)


if __name__ == "__main__":
    main()
