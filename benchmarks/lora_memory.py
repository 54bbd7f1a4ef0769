"""The memory LoRA saves where it matters: a GPT-2-small-shaped model, full fine-tune against LoRA.

    python benchmarks/lora_memory.py [--n-layer 12] [--n-embed 768] [--vocab 50304]
        [--batch 4] [--context 256] [--steps 3] [--rank 16]

On the chat example's 0.8M-parameter model the activations and the runtime are most of a step's
memory, and adapters save nothing there (docs/lora.md). On a model the size of GPT-2 small
(124M parameters) the weights' gradients and Adam's two moments are 12 bytes a parameter beside
the weights' 4, which LoRA leaves out for the frozen base. This trains `--steps` steps of
`llmcli.training.step.train_step` each way, each in a process of its own (a process's peak
resident memory only grows), on random weights and tokens, and reports for each:

- `peak_rss_mib`: the process's peak resident memory (`ru_maxrss`), the interpreter and torch
  included;
- `estimate_mib`: what `llmcli plan` estimates for the same step (`estimate_memory`'s peak);
- `step_s`: the median step time (the first step left out);

and `lora_over_full` for both figures. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 2**20


def one_way(args: argparse.Namespace) -> dict:
    """Train `args.steps` steps of one way (`args.way`) in this process; its figures."""
    import torch

    from llmcli.config import Config, DataConfig, LoraConfig, ModelConfig, TrainConfig
    from llmcli.model.gpt import Transformer
    from llmcli.model.lora import add_lora, freeze_base
    from llmcli.training.memory import estimate_memory
    from llmcli.training.optim import build_optimizer
    from llmcli.training.precision import Precision
    from llmcli.training.step import Trainer, train_step

    model_cfg = ModelConfig(
        n_layer=args.n_layer,
        n_head=args.n_embed // 64,
        n_embed=args.n_embed,
        context_length=args.context,
        dropout=0.0,
    )
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank) if args.way == "lora" else None
    # The estimate of a LoRA run reads its base's vocabulary size (new token rows would train):
    # a folder with a Hugging Face config.json of this vocabulary says none are added.
    base = Path(tempfile.mkdtemp())
    (base / "config.json").write_text(json.dumps({"vocab_size": args.vocab}))
    for name in ("model.safetensors", "tokenizer.json"):
        (base / name).touch()
    tc = TrainConfig(lr=1e-4, batch_size=args.batch, lora=lora, init_from=str(base))
    config = Config(model=model_cfg, data=DataConfig(), train=tc)
    model = Transformer(model_cfg, args.vocab, generator=torch.Generator().manual_seed(0))
    if lora is not None:
        add_lora(model, lora, torch.Generator().manual_seed(1))
        freeze_base(model)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g)

    class SameBatch:
        def next(self):
            return ids[:, :-1], ids[:, 1:]

    trainer = Trainer(
        model=model,
        params=[p for p in model.parameters() if p.requires_grad],
        optimizer=build_optimizer(model, tc, "cpu"),
        precision=Precision.resolve(torch.device("cpu"), "float32"),
        batches=SameBatch(),
        grad_accum=1,
        grad_clip=1.0,
    )
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        train_step(trainer)
        times.append(time.perf_counter() - start)
    estimate = estimate_memory(config, args.vocab, "cpu", "float32", 1)
    return {
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB),
        "estimate_mib": round(estimate.peak / MIB),
        "step_s": round(statistics.median(times[1:] or times), 3),
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embed", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--way", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way:  # a child: one way, its figures on stdout
        print(json.dumps(one_way(args)))
        return
    ways = {}
    for way in ("full", "lora"):
        command = [sys.executable, __file__, *sys.argv[1:], "--way", way]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        ways[way] = json.loads(out.strip().splitlines()[-1])
    full, lora = ways["full"], ways["lora"]
    print(
        json.dumps(
            {
                "benchmark": "lora_memory",
                "n_layer": args.n_layer,
                "n_embed": args.n_embed,
                "vocab": args.vocab,
                "batch": args.batch,
                "context": args.context,
                "rank": args.rank,
                "full": full,
                "lora": lora,
                "lora_over_full": {
                    key: round(lora[key] / full[key], 3)
                    for key in ("peak_rss_mib", "estimate_mib", "step_s")
                },
                "machine": platform.machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
