"""What LoRA costs and saves a step, and what reading a LoRA run costs merged or applied on the fly.

    OMP_NUM_THREADS=1 python benchmarks/lora_cost.py [--rounds 10] [--steps 10]
        [--n-layer 4] [--n-embed 128] [--rank 8] [--threads N]

On the chat example's model shape (4 layers, 128 wide, context 64, 87 tokens; `--n-layer` and
`--n-embed` for another), random weights and tokens, in interleaved rounds so that a busy
machine slows both ways alike:

- `train_step_full_s` / `train_step_lora_s`: one `llmcli.training.step.train_step` of 32 rows
  (the chat example's batch) for a full fine-tune (AdamW on every weight) and for LoRA (rank
  `--rank` on all four layers of every block, the new token rows trainable as a chat run's);
  `lora_step_ratio` is LoRA's over the full one's. The backward still runs through every
  layer (the adapters' inputs need it); what LoRA leaves out is the base's weight gradients
  and their optimizer update.
- `decode_merged_ms` / `decode_on_the_fly_ms`: a new token's time when sampling 48 tokens
  after a 16-token prompt, batch 1, greedy, as `llmcli sample` runs it
  (`FastDecoder.for_model`): on the merged weights, which a LoRA run's `model.safetensors`
  holds and every reader loads, and on the adapted model, adapters applied in each layer (the
  fast step does not apply to it, so it decodes through the model's forward).
- `forward_merged_ms` / `forward_on_the_fly_ms`: one full-window forward of 8 rows (what
  `llmcli eval` and looking inside run), likewise.
- `tokens_equal`: the greedy tokens of both ways are the same.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.config import LoraConfig, ModelConfig, SampleConfig, TrainConfig  # noqa: E402
from llmcli.generation.engine import generate  # noqa: E402
from llmcli.generation.fast_decode import FastDecoder  # noqa: E402
from llmcli.model.gpt import Transformer  # noqa: E402
from llmcli.model.lora import (  # noqa: E402
    add_lora,
    freeze_base,
    merged_state_dict,
    train_token_rows,
)
from llmcli.training.optim import build_optimizer  # noqa: E402
from llmcli.training.precision import Precision  # noqa: E402
from llmcli.training.step import Trainer, train_step  # noqa: E402

VOCAB, BASE_VOCAB, BATCH = 87, 83, 32  # the chat example's: 4 chat tokens added to tiny's 83


class SameBatch:
    def __init__(self, batch):
        self.batch = batch

    def next(self):
        return self.batch


def trainer_for(model: Transformer, ids: torch.Tensor, no_decay: list[str]) -> Trainer:
    tc = TrainConfig(lr=1e-3)
    return Trainer(
        model=model,
        params=[p for p in model.parameters() if p.requires_grad],
        optimizer=build_optimizer(model, tc, "cpu", no_decay),
        precision=Precision.resolve(torch.device("cpu"), "float32"),
        batches=SameBatch((ids[:, :-1], ids[:, 1:])),
        grad_accum=1,
        grad_clip=1.0,
    )


def with_trained_adapters(model: Transformer, seed: int) -> Transformer:
    """Give every adapter's B values (it starts at zero, a no-op that hides its cost)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0.0, 0.02, generator=g)
    return model


def interleaved(ways: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """The median over `rounds` of each way's own median, the ways' order alternating."""
    for fn in ways.values():  # warm-up
        fn()
    medians: dict[str, list[float]] = {way: [] for way in ways}
    for r in range(rounds):
        for way in ways if r % 2 == 0 else reversed(list(ways)):
            medians[way].append(ways[way]())
    return {way: statistics.median(m) for way, m in medians.items()}


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="timed calls per round and way")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embed", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = ModelConfig(
        n_layer=args.n_layer, n_head=4, n_embed=args.n_embed, context_length=64, dropout=0.0
    )
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    g = torch.Generator().manual_seed(0)
    full = Transformer(config, VOCAB, generator=g)
    adapted = Transformer(config, VOCAB)
    adapted.load_state_dict(full.state_dict())
    add_lora(adapted, lora, g)
    freeze_base(adapted)
    rows = train_token_rows(adapted, BASE_VOCAB)
    ids = torch.randint(0, VOCAB, (BATCH, config.context_length + 1), generator=g)
    trainers = {"full": trainer_for(full, ids, []), "lora": trainer_for(adapted, ids, rows)}
    steps = interleaved(
        {
            way: lambda t=t: median_time(lambda: train_step(t), args.steps)
            for way, t in trainers.items()
        },
        args.rounds,
    )

    on_the_fly = with_trained_adapters(adapted, 1).eval()
    merged = Transformer(config, VOCAB)  # what a LoRA run's model.safetensors holds
    merged.load_state_dict(merged_state_dict(on_the_fly))
    merged.eval()
    prompt = ids[0, :16].tolist()
    sample = SampleConfig(max_new_tokens=48, temperature=0.0)

    def decode(model: Transformer) -> list[int]:
        step = FastDecoder.for_model(model)
        with torch.inference_mode():
            return [int(t) for t in generate(model, [prompt], sample, decode=step)]

    def forward(model: Transformer) -> None:
        with torch.inference_mode():
            model(ids[:8, :-1])

    models = {"merged": merged, "on_the_fly": on_the_fly}
    decode_s = interleaved(
        {way: lambda m=m: median_time(lambda: decode(m), args.steps) for way, m in models.items()},
        args.rounds,
    )
    forward_s = interleaved(
        {way: lambda m=m: median_time(lambda: forward(m), args.steps) for way, m in models.items()},
        args.rounds,
    )
    print(
        json.dumps(
            {
                "benchmark": "lora_cost",
                "n_layer": args.n_layer,
                "n_embed": args.n_embed,
                "rank": args.rank,
                "threads": torch.get_num_threads(),
                "rounds": args.rounds,
                "trainable_full": sum(p.numel() for p in full.parameters()),
                "trainable_lora": sum(p.numel() for p in adapted.parameters() if p.requires_grad),
                "train_step_full_s": round(steps["full"], 5),
                "train_step_lora_s": round(steps["lora"], 5),
                "lora_step_ratio": round(steps["lora"] / steps["full"], 3),
                "decode_merged_ms": round(1e3 * decode_s["merged"] / 48, 4),
                "decode_on_the_fly_ms": round(1e3 * decode_s["on_the_fly"] / 48, 4),
                "forward_merged_ms": round(1e3 * forward_s["merged"], 3),
                "forward_on_the_fly_ms": round(1e3 * forward_s["on_the_fly"], 3),
                "tokens_equal": decode(merged) == decode(on_the_fly),
                "torch": torch.__version__,
                "machine": platform.machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
