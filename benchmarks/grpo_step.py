"""What a GRPO step costs, and what sharing each prompt's prefill among its group saves of it.

    OMP_NUM_THREADS=1 python benchmarks/grpo_step.py [--run checkpoints/chat] [--rounds 6]
        [--steps 3] [--threads N]

A GRPO step (`llmcli.objectives.grpo.GRPOObjective` in `llmcli.training.step.train_step`) samples
`train.group_size` replies to each of `train.batch_size` prompts from the policy, rewards them,
and runs the update on every reply. This times whole steps of `configs/grpo.yaml` (8 prompts of
`data/grpo-train.jsonl`, 8 replies each, up to 32 new tokens) from `--run` (the chat example's
run), in interleaved rounds, two ways:

- `step_shared_s`: the replies to one prompt share its prefill (what `generate` does);
- `step_per_row_s`: every reply prefilled alone (the engine's window made with
  `share_prefill=False`, as `benchmarks/shared_prefill.py` does);

and `sampling_share`: the part of a shared step spent sampling (the rest is the rewards and the
update). Both ways draw the same replies (`replies_equal`). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.config import load_config  # noqa: E402
from llmcli.data.prompts import PromptSampler, prompt_token_data  # noqa: E402
from llmcli.generation import engine  # noqa: E402
from llmcli.model.gpt import Transformer  # noqa: E402
from llmcli.objectives.base import init_encoding  # noqa: E402
from llmcli.objectives.grpo import GRPOObjective  # noqa: E402
from llmcli.objectives.rewards import load_rewards  # noqa: E402
from llmcli.training.init_from import load_init_weights, resolve_init_from  # noqa: E402
from llmcli.training.optim import build_optimizer  # noqa: E402
from llmcli.training.precision import Precision  # noqa: E402
from llmcli.training.step import Trainer, train_step  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=str(ROOT / "checkpoints" / "chat"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="steps timed per round and way")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = load_config(ROOT / "configs" / "grpo.yaml")
    train = dataclasses.replace(config.train, init_from=args.run)
    config = resolve_init_from(dataclasses.replace(config, train=train))
    tokenizer, template = init_encoding(config)
    data = prompt_token_data(config.data, config.model.context_length, tokenizer, template)
    model = Transformer(config.model, tokenizer.vocab_size)
    load_init_weights(model, args.run)
    objective = GRPOObjective(
        model, data.prompts, config, load_rewards(config.train.reward_specs), tokenizer.decode
    )
    trainer = Trainer(
        model=model,
        params=list(model.parameters()),
        optimizer=build_optimizer(model, config.train, "cpu"),
        precision=Precision.resolve(torch.device("cpu"), "float32"),
        batches=PromptSampler(data.prompts.train, config.train.batch_size, seed=0),
        grad_accum=1,
        grad_clip=1.0,
        loss_fn=objective,
    )
    unshared = functools.partial(engine.ContextWindow, share_prefill=False)
    batch = trainer.batches.next()

    def sampled(shared: bool) -> list[str]:
        with mock.patch.object(
            engine, "ContextWindow", engine.ContextWindow if shared else unshared
        ):
            return objective.sample(batch).texts

    def round_median(shared: bool) -> float:
        times = []
        with mock.patch.object(
            engine, "ContextWindow", engine.ContextWindow if shared else unshared
        ):
            for _ in range(args.steps):
                start = time.perf_counter()
                train_step(trainer)
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def sampling_median() -> float:
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            objective.sample(batch)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    equal = sampled(True) == sampled(False)
    for shared in (True, False):  # warm-up
        round_median(shared)
    medians: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for shared in (True, False) if r % 2 == 0 else (False, True):
            medians[shared].append(round_median(shared))
    shared_s, per_row_s = (statistics.median(medians[w]) for w in (True, False))
    print(
        json.dumps(
            {
                "benchmark": "grpo_step",
                "prompts": config.train.batch_size,
                "group_size": config.train.group_size,
                "max_new_tokens": config.sample.max_new_tokens,
                "threads": torch.get_num_threads(),
                "rounds": args.rounds,
                "step_shared_s": round(shared_s, 4),
                "step_per_row_s": round(per_row_s, 4),
                "saving": round(1 - shared_s / per_row_s, 3),
                "sampling_share": round(sampling_median() / shared_s, 3),
                "replies_equal": equal,
                "torch": torch.__version__,
                "machine": platform.machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
