"""What one prefill per prompt saves: N samples of one prompt, its prefill shared or per row.

    OMP_NUM_THREADS=1 python benchmarks/shared_prefill.py [--prompt-tokens 48]
        [--new-tokens 16] [--samples 8] [--rounds 10] [--runs 5] [--threads 1]

`generate` (`llmcli.generation.engine`) prefills each distinct prompt once and copies its KV
cache rows to the rows that repeat it (`ContextWindow.prefill`, `shared_prefill`,
`KVCache.copy_rows`). This times `generate_ids` as `llmcli sample --num-samples N` runs it (one
batch of N rows of one prompt, the fast decode step, llmcli's default sampling: temperature 0.8,
top-k 200, seed 1337) on the tiny config's model shape (4 layers, 128 wide, context 64, a
65-token vocabulary, random weights: speed does not depend on them), both ways, in interleaved
rounds so that a busy machine slows both alike:

- `generate_shared_s`: as it is, the prompt prefilled once;
- `generate_per_row_s`: every row prefilled, as before (the engine's window made with
  `share_prefill=False`: `generate` itself has no switch);
- `first_step_*_s`: the first step alone (`next(generate(...))`: set-up, the prefill, the first
  draw), where the saving is;
- `saving`: 1 - shared / per row, of the whole generation, median over rounds;
  `first_step_saving` the same for the first step;
- `tokens_equal`: both ways draw the same tokens.

Each figure is the median over rounds of each round's median of `--runs` generations. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.config import ModelConfig, SampleConfig  # noqa: E402
from llmcli.generation import engine  # noqa: E402
from llmcli.generation.engine import ContextWindow, generate, generate_ids  # noqa: E402
from llmcli.generation.fast_decode import FastDecoder  # noqa: E402
from llmcli.model.gpt import Transformer  # noqa: E402

VOCAB = 65


def per_row(fn: Callable[[], object]) -> object:
    """`fn()` with every row prefilled: the engine's window made with `share_prefill=False`."""
    unshared = functools.partial(ContextWindow, share_prefill=False)
    with mock.patch.object(engine, "ContextWindow", unshared):
        return fn()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="rows of the one prompt")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--runs", type=int, default=5, help="generations timed per round and way")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = ModelConfig(n_layer=4, n_head=4, n_embed=128, context_length=64, dropout=0.0)
    g = torch.Generator().manual_seed(0)
    model = Transformer(config, VOCAB, generator=g).eval()
    prompt = torch.randint(0, VOCAB, (args.prompt_tokens,), generator=g).tolist()
    prompts = [prompt] * args.samples
    sample = SampleConfig(max_new_tokens=args.new_tokens, temperature=0.8, top_k=200, seed=1337)
    decode = FastDecoder.for_model(model)

    def whole() -> list[list[int]]:
        return generate_ids(model, prompts, sample, decode=decode)

    def first_step() -> torch.Tensor:
        return next(generate(model, prompts, sample, decode=decode))

    ways: dict[str, Callable[[Callable[[], object]], object]] = {
        "shared": lambda fn: fn(),
        "per_row": per_row,
    }

    def round_median(way: str, fn: Callable[[], object]) -> float:
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            ways[way](fn)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    tokens_equal = whole() == per_row(whole)
    for way in ways:  # warm-up
        round_median(way, whole)
        round_median(way, first_step)
    medians: dict[str, list[float]] = {
        f"{part}_{way}": [] for part in ("whole", "first") for way in ways
    }
    for r in range(args.rounds):
        for way in ways if r % 2 == 0 else reversed(list(ways)):
            medians[f"whole_{way}"].append(round_median(way, whole))
            medians[f"first_{way}"].append(round_median(way, first_step))

    def saving(part: str) -> float:
        pairs = zip(medians[f"{part}_shared"], medians[f"{part}_per_row"], strict=True)
        return round(statistics.median(1 - s / p for s, p in pairs), 3)

    def median(key: str) -> float:
        return round(statistics.median(medians[key]), 5)

    print(
        json.dumps(
            {
                "benchmark": "shared_prefill",
                "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens,
                "samples": args.samples,
                "context_length": config.context_length,
                "threads": torch.get_num_threads(),
                "rounds": args.rounds,
                "runs": args.runs,
                "generate_shared_s": median("whole_shared"),
                "generate_per_row_s": median("whole_per_row"),
                "saving": saving("whole"),
                "first_step_shared_s": median("first_shared"),
                "first_step_per_row_s": median("first_per_row"),
                "first_step_saving": saving("first"),
                "tokens_equal": tokens_equal,
                "torch": torch.__version__,
                "machine": platform.machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
