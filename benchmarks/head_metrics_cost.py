"""What `train.head_metrics` costs: its work at an evaluation against the training it follows.

    python benchmarks/head_metrics_cost.py [--config tiny] [--rounds 5] [--threads N]

With `train.head_metrics`, each evaluation also measures the validation loss at each position
(from the logits the loss estimate computes anyway) and runs the model once on the probe of
repeated random tokens, scoring every head (`llmcli.evaluation.probe`). This times, on the
config's model (initialised with its seed; speed does not depend on the weights) and batches of
random tokens, in interleaved rounds so that a busy machine slows all alike:

- `step_s`: one training step (forward, backward, optimizer step);
- `eval_s` / `eval_by_position_s`: the loop's loss estimate (`eval_steps` batches of each split)
  without and with the loss by position;
- `probe_s`: the probe's forward and scores.

`cost` is the extra work of one evaluation, (eval_by_position - eval) + probe, over the time of
the `eval_interval` training steps and the evaluation that one evaluation covers (saves, logging
and start-up left out, which makes the share larger than in a real run). Medians over the
rounds. Prints one JSON object.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.config import load_config  # noqa: E402
from llmcli.data.tokenizer import CharTokenizer  # noqa: E402
from llmcli.evaluation.probe import make_probe, probe_scores  # noqa: E402
from llmcli.model.gpt import Transformer  # noqa: E402
from llmcli.training.distributed import DistInfo  # noqa: E402
from llmcli.training.evaluate import evaluate_loss  # noqa: E402
from llmcli.training.optim import build_optimizer  # noqa: E402
from llmcli.training.precision import Precision  # noqa: E402

# The bundled corpus's characters: the probe draws from the tokenizer's non-space tokens.
CHARS = sorted(set((ROOT / "data" / "shakespeare.txt").read_text(encoding="utf-8")[:200_000]))


class RandomBatches:
    """A sampler of random token batches `(B, T)`, from its own generator."""

    def __init__(self, vocab: int, batch: int, context: int, seed: int) -> None:
        self.shape, self.vocab = (batch, context), vocab
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(self.vocab, self.shape, generator=self.gen)
        return x, torch.randint(self.vocab, self.shape, generator=self.gen)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(args.config)
    mc, tc = config.model, config.train
    tok = CharTokenizer(CHARS)
    model = Transformer(mc, tok.vocab_size, generator=torch.Generator().manual_seed(tc.seed))
    optimizer = build_optimizer(model, tc, "cpu")
    precision = Precision.resolve(torch.device("cpu"), "float32")
    train_batches = RandomBatches(tok.vocab_size, tc.batch_size, mc.context_length, 0)
    probe = make_probe(tok, mc.context_length)

    def step() -> None:
        _, loss = model(*train_batches.next())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def evaluate(by_position: bool) -> None:
        samplers = {
            split: RandomBatches(tok.vocab_size, tc.batch_size, mc.context_length, seed)
            for split, seed in (("train", 1), ("val", 2))
        }
        evaluate_loss(
            model, samplers, tc.eval_steps, precision, DistInfo(), by_position=by_position
        )

    times: dict[str, list[float]] = {k: [] for k in ("step", "eval", "eval_by_position", "probe")}
    step()  # warm-up
    for _ in range(args.rounds):
        times["step"].append(statistics.median(timed(step) for _ in range(20)))
        times["eval"].append(timed(lambda: evaluate(False)))
        times["eval_by_position"].append(timed(lambda: evaluate(True)))
        times["probe"].append(timed(lambda: probe_scores(model, probe)))
    med = {k: statistics.median(v) for k, v in times.items()}
    extra = med["eval_by_position"] - med["eval"] + med["probe"]
    interval = tc.eval_interval * med["step"] + med["eval"]
    print(
        json.dumps(
            {
                "config": args.config,
                "eval_interval": tc.eval_interval,
                "eval_steps": tc.eval_steps,
                "probe": probe.describe(),
                **{f"{k}_s": round(v, 5) for k, v in med.items()},
                "extra_per_eval_s": round(extra, 5),
                "cost": round(extra / interval, 5),
                "threads": torch.get_num_threads(),
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
