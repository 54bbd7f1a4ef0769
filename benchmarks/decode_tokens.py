"""Does the decode step sample the same tokens as the model's `forward`? Prints JSON.

On the CPU `llmcli sample` runs a generation whose steps are mostly small decode steps inside
`small_gelu` (`llmcli/generation/decode.py`; `llmcli.generation.sample.decode_kernels` decides),
which puts GELU on ATen's kernel, while `Transformer.forward` elsewhere runs oneDNN's; the two may
differ in the last bit of some values. This samples a trained run with
`llmcli.generation.generate` both ways, seed by seed, and counts the seeds whose tokens differ
anywhere, and the largest logit difference over a window of greedy steps (the decode step inside
`small_gelu`, `forward` outside it):

- `shift` (the default policy): the decode step with the kernel `llmcli sample` picks (ATen's),
  against `forward` with the KV cache (the decoder switched off, oneDNN's GELU), `--tokens` new
  tokens per seed, so that most steps are decode steps;
- `exact` with the kernel `llmcli sample` picks (oneDNN's when the tokens go past the context),
  against `generate` as it was at the baseline revision (`7fa4a5b`, before the context policies
  and the decode step): the same tokens as before, for the same seed.

Usage: python benchmarks/decode_tokens.py [--run RUN] [--seeds 50] [--tokens 500]
(RUN: a trained run, by default the repository's checkpoints/tiny)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from git_baseline import load_baseline

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.config import SampleConfig  # noqa: E402
from llmcli.errors import CheckpointError  # noqa: E402
from llmcli.generation import generate  # noqa: E402
from llmcli.generation.decode import Decoder, small_gelu  # noqa: E402
from llmcli.generation.sample import decode_kernels  # noqa: E402
from llmcli.runs.loading import load_run  # noqa: E402

BASELINE = "7fa4a5b"


def largest_logit_difference(model: torch.nn.Module, steps: int) -> float:
    """Max |decode step - forward| over `steps` greedy steps from a 1-token prompt, the step
    inside `small_gelu` (as `llmcli sample` runs it), `forward` outside it."""
    worst = 0.0
    with torch.inference_mode():
        ours, theirs = model.new_kv_cache(1), model.new_kv_cache(1)
        idx = torch.tensor([[1]])
        model(idx, kv_cache=ours)
        model(idx, kv_cache=theirs)
        decoder = Decoder(model)
        token = torch.tensor([1])
        for _ in range(min(steps, model.context_length - 1)):
            with small_gelu(model, 1):
                got = decoder(token, ours, None)  # (1, V)
            expected = model(token[:, None], kv_cache=theirs)[0][:, -1]  # (1, V)
            worst = max(worst, (got - expected).abs().max().item())
            token = got.argmax(-1)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=str(ROOT / "checkpoints" / "tiny"))
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        run = load_run(args.run)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    model, cfg = run.model, run.config.sample
    baseline = load_baseline(BASELINE)
    old = baseline["model"].Transformer.from_config(run.config.model, model.vocab_size).eval()
    old.load_state_dict(model.state_dict())
    kw = dict(temperature=args.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    start = time.perf_counter()
    differ = {"shift_decoder_vs_forward": 0, "exact_vs_baseline": 0}
    for seed in range(args.seeds):
        config = SampleConfig(max_new_tokens=args.tokens, seed=seed, **kw)
        with decode_kernels(model, config, 1):
            ours = generate.generate_ids(model, [[1]], config)
        with mock.patch.object(generate, "decoder_for", lambda m: None):
            theirs = generate.generate_ids(model, [[1]], config)
        differ["shift_decoder_vs_forward"] += ours != theirs
        exact = dataclasses.replace(config, context_policy="exact")
        with decode_kernels(model, exact, 1):
            ours = generate.generate_ids(model, [[1]], exact)
        theirs = baseline["generate"].generate_ids(old, [[1]], args.tokens, seed=seed, **kw)
        differ["exact_vs_baseline"] += ours != theirs
    print(
        json.dumps(
            {
                "run": args.run,
                "seeds": args.seeds,
                "new_tokens_per_seed": args.tokens,
                "sampling": kw,
                "tokens_compared_per_check": args.seeds * args.tokens,
                "seeds_whose_tokens_differ": differ,
                "max_abs_logit_difference_decode_vs_forward": largest_logit_difference(
                    model, args.tokens
                ),
                "baseline": baseline["rev"],
                "torch": torch.__version__,
                "seconds": round(time.perf_counter() - start, 1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
