"""Where the compiled decode step pays: its step against the default fast step, by rows and shape.

    OMP_NUM_THREADS=1 python benchmarks/compiled_step.py [--rows 1,2,4,8] [--shapes tiny,6l384]
        [--steps 16] [--rounds 7] [--runs 3] [--threads 1] [--cache-dir DIR]

`llmcli sample --compile` decodes with `llmcli.generation.compiled_decode.CompiledDecoder` (the
model's forward for one new token per row, compiled ahead of time by AOTInductor) where it
measured faster, and with `llmcli.generation.fast_decode.FastDecoder` (the default) elsewhere.
This measures both steps after the compile (each shape and row count compiled once, before the
timing, into `--cache-dir`, where a rerun finds them), on random weights (the time does not
depend on them) of two shapes:

- `tiny`: the tiny config's model, 4 layers of 128, 4 heads, context 64, a 65-token vocabulary;
- `6l384`: 6 layers of 384, 6 heads, context 512, a 512-token vocabulary.

Each case fills the KV cache of `rows` rows with half a context of prompt, then times `--steps`
decode steps, the cache cropped back to the prompt before every run. Rounds alternate which side
goes first; each round times each side `--runs` times (median); `compiled_over_fast` is the
median over rounds of each round's compiled / fast ratio (below 1: the compiled step is faster),
so that a busy machine slows both alike. `logits_close`: the two steps' logits agree to 1e-4.
`compile_s`: the compile's seconds (0 when the cache held it). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.config import ModelConfig  # noqa: E402
from llmcli.generation.compiled_decode import CompiledDecoder  # noqa: E402
from llmcli.generation.fast_decode import FastDecoder  # noqa: E402
from llmcli.model.gpt import Transformer  # noqa: E402

SHAPES = {
    "tiny": (ModelConfig(n_layer=4, n_head=4, n_embed=128, context_length=64, dropout=0.0), 65),
    "6l384": (ModelConfig(n_layer=6, n_head=6, n_embed=384, context_length=512, dropout=0.0), 512),
}


def case(
    model: Transformer, rows: int, args: argparse.Namespace, cache_dir: Path
) -> dict[str, object]:
    """Compile (or load) the step for `rows` rows, then time it against the fast step."""
    start = time.perf_counter()
    compiled = CompiledDecoder.for_model(model, rows, cache_dir=cache_dir, notify=note)
    compile_s = time.perf_counter() - start
    fast = FastDecoder.for_model(model)
    g = torch.Generator().manual_seed(rows)
    P = model.context_length // 2
    prompt = torch.randint(0, model.vocab_size, (rows, P), generator=g)
    ids = torch.randint(0, model.vocab_size, (args.steps, rows), generator=g)
    cache = model.new_kv_cache(rows)
    with torch.inference_mode():
        model(prompt, kv_cache=cache)

    def run(step: Callable[..., torch.Tensor | None]) -> torch.Tensor | None:
        cache.crop(P)
        logits = None
        with torch.inference_mode():
            for i in range(args.steps):
                logits = step(ids[i], cache, None, None)
        return logits

    sides = {"compiled": compiled, "fast": fast}
    last = {name: run(step) for name, step in sides.items()}  # warm-up, and the logits
    close = torch.allclose(last["compiled"], last["fast"], atol=1e-4, rtol=1e-4)
    per_round: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in sides if r % 2 == 0 else reversed(list(sides)):
            times = []
            for _ in range(args.runs):
                start = time.perf_counter()
                run(sides[name])
                times.append((time.perf_counter() - start) / args.steps)
            per_round[name].append(statistics.median(times))
    pairs = zip(per_round["compiled"], per_round["fast"], strict=True)
    return {
        "rows": rows,
        "compiled_step_ms": round(statistics.median(per_round["compiled"]) * 1e3, 4),
        "fast_step_ms": round(statistics.median(per_round["fast"]) * 1e3, 4),
        "compiled_over_fast": round(statistics.median(c / f for c, f in pairs), 3),
        "logits_close": bool(close),
        "compile_s": round(compile_s, 1),
    }


def note(message: str) -> None:
    print(message, file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--shapes", default="tiny,6l384")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=3, help="runs timed per round and side")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", type=Path, default=None, help="the compile cache")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cache_dir = args.cache_dir or Path(tempfile.gettempdir()) / "llmcli-compiled-step"
    results = []
    for name in args.shapes.split(","):
        config, vocab = SHAPES[name]
        model = Transformer(config, vocab, generator=torch.Generator().manual_seed(0)).eval()
        cases = []
        for rows in (int(r) for r in args.rows.split(",")):
            cases.append(case(model, rows, args, cache_dir))
            note(f"{name} rows {rows}: {cases[-1]}")
        shape = f"{config.n_layer}L/{config.n_embed}, {config.n_head} heads"
        results.append(
            {
                "shape": name,
                "model": shape,
                "context_length": config.context_length,
                "vocab_size": vocab,
                "parameters": sum(p.numel() for p in model.parameters()),
                "cases": cases,
            }
        )
    print(
        json.dumps(
            {
                "benchmark": "compiled_step",
                "threads": torch.get_num_threads(),
                "steps": args.steps,
                "rounds": args.rounds,
                "runs": args.runs,
                "results": results,
                "torch": torch.__version__,
                "machine": platform.machine(),
            }
        )
    )


if __name__ == "__main__":
    main()
