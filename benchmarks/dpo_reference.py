"""What DPO's frozen reference costs a step: scored live under `no_grad`, or read from a cache.

    OMP_NUM_THREADS=1 python benchmarks/dpo_reference.py [--pairs 16] [--rounds 10]
        [--steps 10] [--threads N]

A DPO step (`llmcli.objectives.dpo.dpo_step`) runs the policy forward and backward on a batch's
2B rows and the reference forward on the same rows. The reference's log-probabilities never
change, so they could be computed once per pair and kept (TRL's `precompute_ref_log_probs`).
This times the loop's own step (`llmcli.training.step.train_step`) both ways on the tiny
config's model shape (4 layers, 128 wide, context 64, a 69-token vocabulary: `configs/dpo.yaml`
fine-tunes a run of that shape), on random tokens, in interleaved rounds so that a busy machine
slows both alike:

- `step_live_s`: the reference scored in every step (what `train.objective: dpo` does);
- `step_cached_s`: the reference's scores given (a cache hit), the policy alone;
- `saving`: 1 - cached / live, the most a cache could save, when every pair is drawn many
  times; a cache also costs one reference forward per pair to fill, once, and a pair drawn
  once gains nothing.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.config import ModelConfig, TrainConfig  # noqa: E402
from llmcli.model.gpt import Transformer  # noqa: E402
from llmcli.objectives.dpo import dpo_objective  # noqa: E402
from llmcli.objectives.dpo_losses import DPOLoss, dpo_loss  # noqa: E402
from llmcli.objectives.preference_scores import target_logps, target_scores  # noqa: E402
from llmcli.training.optim import build_optimizer  # noqa: E402
from llmcli.training.precision import Precision  # noqa: E402
from llmcli.training.step import Trainer, train_step  # noqa: E402

VOCAB, BETA = 69, 0.1


class SameBatch:
    def __init__(self, batch):
        self.batch = batch

    def next(self):
        return self.batch


def cached_objective(ref_logps: torch.Tensor):
    """The step's loss with the reference's scores given: the policy's forward only."""

    def loss_fn(policy, batch):
        ids, mask = batch
        chosen, rejected = target_scores(policy(ids[:, :-1])[0], ids[:, 1:], mask[:, 1:]).halves()
        B = ids.shape[0] // 2
        return dpo_loss(chosen, rejected, ref_logps[:B], ref_logps[B:], DPOLoss(BETA))

    return loss_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=16, help="pairs per batch")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="steps timed per round and way")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = ModelConfig(n_layer=4, n_head=4, n_embed=128, context_length=64, dropout=0.0)
    g = torch.Generator().manual_seed(0)
    policy, reference = Transformer(config, VOCAB, generator=g), Transformer(config, VOCAB)
    reference.load_state_dict(policy.state_dict())
    reference.eval().requires_grad_(False)
    T = config.context_length
    ids = torch.randint(0, VOCAB, (2 * args.pairs, T + 1), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, T // 2 :] = True  # the second half of each row is the completion
    with torch.no_grad():
        ref_logps = target_logps(reference(ids[:, :-1])[0], ids[:, 1:], mask[:, 1:])
    tc = TrainConfig(lr=1e-4, dpo_beta=BETA)
    trainer = Trainer(
        model=policy,
        params=list(policy.parameters()),
        optimizer=build_optimizer(policy, tc, "cpu"),
        precision=Precision.resolve(torch.device("cpu"), "float32"),
        batches=SameBatch((ids, mask)),
        grad_accum=1,
        grad_clip=1.0,
    )
    ways = {"live": dpo_objective(reference, tc), "cached": cached_objective(ref_logps)}

    def round_median(way: str) -> float:
        trainer.loss_fn = ways[way]
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            train_step(trainer)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    for way in ways:  # warm-up
        round_median(way)
    medians: dict[str, list[float]] = {way: [] for way in ways}
    for r in range(args.rounds):
        for way in ways if r % 2 == 0 else reversed(list(ways)):
            medians[way].append(round_median(way))
    live, cached = (statistics.median(medians[way]) for way in ways)
    savings = [1 - c / v for v, c in zip(medians["live"], medians["cached"], strict=True)]
    print(
        json.dumps(
            {
                "benchmark": "dpo_reference",
                "pairs": args.pairs,
                "context_length": T,
                "threads": torch.get_num_threads(),
                "rounds": args.rounds,
                "step_live_s": round(live, 5),
                "step_cached_s": round(cached, 5),
                "saving": round(statistics.median(savings), 3),
                "torch": torch.__version__,
                "machine": platform.machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
