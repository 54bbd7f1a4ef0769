"""The spike guard at work: a tiny run whose stream holds poisoned batches survives them.

    OMP_NUM_THREADS=1 python benchmarks/spike_guard_demo.py [--out DIR] [--steps 200]
        [--lone 60] [--burst 120] [--off]

Trains the shipped `tiny` config for `--steps` steps (evaluating and saving every 50) with one
poisoned batch of the training stream at `--lone` and three in a row from `--burst`: their loss
is multiplied by 100, as a corrupt shard or a bad learning-rate moment would spike it. The
guard skips the lone one; the burst's third skip rolls the run back to its last save, with the
learning rate halved for `spike_lr_steps` steps, on new batches. `--off` runs the same without
the guard, for comparison. Prints the run's events (`metrics.jsonl`'s `"kind": "event"`
records) and its summary as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import llmcli.training.evaluate  # noqa: E402
from llmcli.config import load_config  # noqa: E402
from llmcli.model.gpt import Transformer  # noqa: E402
from llmcli.runs.metrics import read_metrics  # noqa: E402
from llmcli.training.loop import train  # noqa: E402


def poison(batches: set[int], seed: int) -> None:
    """Multiply the loss of the given batches of the training stream (the sampler seeded
    `seed`; evaluation's are seeded apart) by 100."""
    current: dict[str, int] = {}
    real_sampler, real_forward = llmcli.training.evaluate.BatchSampler, Transformer.forward

    class StreamSampler(real_sampler):
        def __init__(self, *args, seed: int, **kwargs) -> None:
            super().__init__(*args, seed=seed, **kwargs)
            self.is_train = seed == train_seed

        def next(self):
            if self.is_train:
                current["batch"] = self.batches
            return super().next()

    def forward(self, idx, targets=None, **kwargs):
        logits, loss = real_forward(self, idx, targets, **kwargs)
        if torch.is_grad_enabled() and current.get("batch") in batches and loss is not None:
            loss = loss * 100.0
        return logits, loss

    train_seed = seed
    llmcli.training.evaluate.BatchSampler = StreamSampler
    Transformer.forward = forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="run directory (default: temp)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lone", type=int, default=60, help="a lone poisoned batch")
    parser.add_argument("--burst", type=int, default=120, help="the first of three in a row")
    parser.add_argument("--off", action="store_true", help="without the guard")
    args = parser.parse_args()
    sets = [
        f"train.max_steps={args.steps}",
        "train.eval_interval=50",
        "train.eval_steps=10",
        f"train.spike_guard={'false' if args.off else 'true'}",
    ]
    config = load_config("tiny", sets)
    poison({args.lone, args.burst, args.burst + 1, args.burst + 2}, config.train.seed)
    with tempfile.TemporaryDirectory() as folder:
        run_dir = args.out or Path(folder) / "run"
        summary = train(config, out_dir=run_dir, overwrite=True, progress=False)
        records = read_metrics(run_dir / "metrics.jsonl")
    for record in records:
        if record.get("kind") == "event":
            print(json.dumps(record))
    losses = {r["step"]: r["train_loss"] for r in records if r.get("kind") == "train"}
    print(
        json.dumps(
            {
                "summary": True,
                "step": summary.step,
                "skipped": summary.skipped,
                "rollbacks": summary.rollbacks,
                "val_loss": summary.val_loss,
                "max_logged_train_loss": max(losses.values()),
            }
        )
    )


if __name__ == "__main__":
    main()
