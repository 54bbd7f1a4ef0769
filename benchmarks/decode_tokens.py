"""Does today's sampling draw the same tokens as a baseline revision's, and as its own plain loop?

    python benchmarks/decode_tokens.py [--run checkpoints/tiny] [--baseline 5b00014]
        [--seeds 60] [--tokens 500] [--temperature 0.8]

`llmcli sample` today runs `generate(model, prompts, config, decode=FastDecoder.for_model(model))`
(`llmcli.generation.fast_decode`: the one-token steps as plain functions of the weights, with
ATen's GELU for small steps on the CPU); the baseline revision's ran its own `generate` inside
`generation.sample.decode_kernels` (its decode step, and ATen's GELU around decode-bound
samples). The two may differ in the last bit of some logits, and a near-tie would then draw
another token. This loads a trained run (`--run`) through each side's own `load_run` (the same
weights: `weights_equal`) and samples it seed by seed, `--tokens` new tokens from the prompt [1]
per seed (batch 1, the run's sampling settings at `--temperature`, only ids of the tokenizer's
vocabulary, as `llmcli sample` does), counting the seeds whose tokens differ anywhere:

- `shift_vs_baseline` / `exact_vs_baseline`: today as `llmcli sample` runs it against the
  baseline as its `llmcli sample` ran it, under each context policy (`shift`, the default: most
  steps are decode steps; `exact`: decode steps inside the context, the whole window recomputed
  past it);
- `shift_fast_vs_plain` / `exact_fast_vs_plain`: today's `FastDecoder` against today's plain
  loop (`decode=None`: every step through `Transformer.forward`);

and `max_abs_logit_difference_fast_vs_forward`: the largest |logit| difference of today's
`FastDecoder` step against the model's forward with a KV cache, over a greedy run inside the
context (`steps_with_equal_logits` of how many). The exit status is 0 whatever differs: this
reports. The baseline side calls its revision's own API (`runs.loading.load_run`,
`generation.generate.generate`, and `generation.sample.decode_kernels` or
`generation.fast_decode.FastDecoder`), so `--baseline` must be a revision that has them, such as
5b00014 or 8bdabf1. Everything runs on the CPU at one thread.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from git_baseline import NAME, fail, load_run_sides

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.generation.engine import generate_ids  # noqa: E402
from llmcli.generation.fast_decode import FastDecoder  # noqa: E402

BASELINE_MODULES = ("generation.generate", "generation.sample", "runs.loading")
POLICIES = ("shift", "exact")


def load_sides(run_dir: Path, rev: str) -> tuple[Any, Any, dict[str, Any]]:
    """Today's loaded run, the baseline's loaded run, the baseline's modules (or exit 2)."""
    today, old, baseline = load_run_sides(run_dir, rev, BASELINE_MODULES)
    if not hasattr(baseline["generation.sample"], "decode_kernels"):
        try:  # a revision whose `llmcli sample` opts into `FastDecoder`, as today's does
            baseline["generation.fast_decode"] = importlib.import_module(
                f"{NAME}.generation.fast_decode"
            )
        except ImportError:
            fail(
                f"--baseline {rev} has neither generation.sample.decode_kernels nor "
                "generation.fast_decode: use one such as 5b00014."
            )
    return today, old, baseline


def baseline_sample(baseline: dict[str, Any], model: Any, config: Any, vocab: int | None) -> Any:
    """The baseline's tokens for the prompt [1], as its `llmcli sample` drew them: its
    `generate` inside its `decode_kernels`, or with its `FastDecoder` step."""
    generate_ids = baseline["generation.generate"].generate_ids
    if "generation.fast_decode" in baseline:
        decoder = baseline["generation.fast_decode"].FastDecoder.for_model(model)
        return generate_ids(model, [[1]], config, vocab_size=vocab, decode=decoder)
    with baseline["generation.sample"].decode_kernels(model, config, 1):
        return generate_ids(model, [[1]], config, vocab_size=vocab)


def same_weights(today: Any, old: Any) -> bool:
    """Whether both sides loaded the same tensors under the same names."""
    ours, theirs = today.model.state_dict(), old.model.state_dict()
    return sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def largest_logit_difference(model: torch.nn.Module, steps: int) -> dict[str, Any]:
    """Max |FastDecoder step - forward| over `steps` greedy steps from the prompt [1] (at most
    the context's), each fed the token the decoder's logits pick, and how many steps were
    equal bit for bit."""
    decoder = FastDecoder.for_model(model)
    assert decoder is not None, "a loaded run's model is a Transformer in eval mode"
    n = min(steps, model.context_length - 1)
    worst, equal = 0.0, 0
    with torch.inference_mode():
        ours, theirs = model.new_kv_cache(1), model.new_kv_cache(1)
        idx = torch.tensor([[1]])
        model(idx, kv_cache=ours)
        model(idx, kv_cache=theirs)
        token = torch.tensor([1])
        for _ in range(n):
            got = decoder(token, ours, None, None)  # (1, V)
            assert got is not None, "no hooks, no autocast: the decoder applies"
            expected = model(token[:, None], kv_cache=theirs)[0][:, -1]  # (1, V)
            worst = max(worst, (got - expected).abs().max().item())
            equal += torch.equal(got, expected)
            token = got.argmax(-1)
    return {"max_abs": worst, "steps": n, "steps_with_equal_logits": equal}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=str(ROOT / "checkpoints" / "tiny"), help="a trained run")
    parser.add_argument("--baseline", default="5b00014", help="git revision to compare with")
    parser.add_argument("--seeds", type=int, default=60, help="seeds to sample, 0 .. N-1")
    parser.add_argument("--tokens", type=int, default=500, help="new tokens per seed")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    args = parser.parse_args()
    torch.set_num_threads(1)
    today, old, baseline = load_sides(Path(args.run), args.baseline)
    model, tokenizer = today.model, today.tokenizer
    # As `llmcli sample` does: only ids of the tokenizer's vocabulary, if the model's is padded.
    vocab = tokenizer.vocab_size if tokenizer.vocab_size < model.vocab_size else None
    sampling = {"temperature": args.temperature, "max_new_tokens": args.tokens}
    start = time.perf_counter()
    differ = {f"{p}_{c}": 0 for p in POLICIES for c in ("vs_baseline", "fast_vs_plain")}
    for seed in range(args.seeds):
        for policy in POLICIES:
            settings = {**sampling, "seed": seed, "context_policy": policy}
            config = dataclasses.replace(today.config.sample, **settings)
            old_config = dataclasses.replace(old.config.sample, **settings)
            fast = generate_ids(
                model, [[1]], config, vocab_size=vocab, decode=FastDecoder.for_model(model)
            )
            plain = generate_ids(model, [[1]], config, vocab_size=vocab)
            theirs = baseline_sample(baseline, old.model, old_config, vocab)
            differ[f"{policy}_vs_baseline"] += fast != theirs
            differ[f"{policy}_fast_vs_plain"] += fast != plain
    sample = dataclasses.replace(today.config.sample, **sampling)
    out = {
        "benchmark": "decode_tokens",
        "seeds_whose_tokens_differ": differ,
        "seeds": args.seeds,
        "new_tokens_per_seed": args.tokens,
        "tokens_compared_per_check": args.seeds * args.tokens,
        "max_abs_logit_difference_fast_vs_forward": largest_logit_difference(model, args.tokens),
        "weights_equal": same_weights(today, old),
        "sampling": {
            "temperature": sample.temperature,
            "top_k": sample.top_k,
            "top_p": sample.top_p,
            "context_keep": sample.context_keep,
            "vocab_size": vocab,
        },
        "run": args.run,
        "step": today.step,
        "baseline": {"requested": args.baseline, "rev": baseline["rev"]},
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
