"""Today's model against a baseline revision's: training step, forward, decode step, long sample.

    python benchmarks/model_speed.py [--baseline 5b00014] [--threads 1] [--rounds 15]
        [--reps 10] [--long-rounds 3] [--long-tokens 2000] [--parts train,forward,decode,long,fast]

The code of today and of the revision `--baseline` run in one process on the `tiny` shape (4
layers, 4 heads, n_embed 128, context 64, vocabulary 65, batches of 12), at `--threads` CPU
threads. Both sides hold the same weights: today's model is built with a fixed seed and its
state_dict loaded into the baseline's model (their keys must agree). Each part runs its two
sides interleaved, round by round, the order alternating (today first in even rounds), so that
a noisy machine slows both alike; a ratio is today / baseline, the median of the per-round
ratios: below 1 today is faster for milliseconds, above 1 for tokens/s.

Each side runs as its own revision's `llmcli train` and `llmcli sample` run it:

- `train_step`: one optimizer step on one random batch (grad_accum 1, fp32, `grad_clip` 1.0,
  AdamW from each side's own `build_optimizer`, the same settings). Today:
  `llmcli.training.step.train_step` on a `Trainer`; the baseline: its training loop's sequence,
  forward under `precision.autocast()`, `precision.backward(loss)`, `precision.step(optimizer,
  params, grad_clip)` (clip, step, zero_grad). ms per step, `--reps` steps a round. Both sides
  take the same steps from the same weights on the same batch, so the first step's loss,
  gradients (before clipping) and gradient norm (an untimed step) and the weights after all
  steps must be equal bit for bit.
- `forward`: the inference forward of that batch under `torch.no_grad()`; ms per forward, `--reps`
  a round; the logits must be equal bit for bit.
- `decode_step`: the cached one-token step inside the context: 63 new tokens from a 1-token
  prompt, greedy and sampled (temperature 0.8, top-k 200, seed 1337); a run's figure is the
  median ms of its steps after the first two (the prefill, then the first cached step); the
  same tokens are required.
- `long_sample`: `--long-tokens` new tokens at batch 1 from a 1-token prompt past the context,
  under `shift` (the default policy), sampled as above; tokens/s; the same tokens are required.
- `fast_vs_forward` (part `fast`): not against the baseline, but today's opt-in decode step
  (`FastDecoder`) against today's plain loop (every step the model's forward), as `decode_step`
  measures, sampled: `fast_over_forward` < 1 is what the faster step saves.

Generation, today: `generate(model, prompts, config, decode=FastDecoder.for_model(model))`, the
decoder built at the start of each generation, as `llmcli sample` runs it; the baseline: its
`generate(model, prompts, config)` inside its `generation.sample.decode_kernels(model, config,
1)` (ATen's GELU for decode-bound samples), as its `llmcli sample` ran it. The two sampling parts
scale the weight matrices by 4, as `sample_throughput.py` does, so that logits are not near-ties.
The baseline side calls its revision's own API (`model.gpt.Transformer(config, vocab,
generator=...)`, `generation.generate.generate`, `generation.sample.decode_kernels`,
`training.optim.build_optimizer`, `training.precision.Precision`), so `--baseline` must be a
revision with the subpackage layout and that API: 5b00014 (before the decode step moved to
`llmcli.generation.fast_decode` and the training step to `llmcli.training.step`).

Prints one JSON object: `ratios` (every part's today / baseline), then per part the medians per
side, the ratio, the per-round figures and its equality checks, `weights` (the state_dict check),
the settings and `machine` (with the load average at start and end).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

import torch
from git_baseline import load_baseline

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmcli.config import ModelConfig, SampleConfig, TrainConfig  # noqa: E402
from llmcli.generation.engine import generate  # noqa: E402
from llmcli.generation.fast_decode import FastDecoder  # noqa: E402
from llmcli.model.gpt import Transformer  # noqa: E402
from llmcli.training.optim import build_optimizer  # noqa: E402
from llmcli.training.precision import Precision  # noqa: E402
from llmcli.training.step import Trainer, train_step  # noqa: E402

TINY = {"n_layer": 4, "n_head": 4, "n_embed": 128, "context_length": 64}
VOCAB, BATCH = 65, 12
TRAIN = {
    "optimizer": "adamw",
    "lr": 1e-3,
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.99,
    "grad_clip": 1.0,
    "grad_accum": 1,
}
SAMPLED = {"temperature": 0.8, "top_k": 200, "seed": 1337}  # llmcli's sample defaults
SIDES = ("today", "baseline")
PARTS = ("train", "forward", "decode", "long", "fast")
BASELINE_MODULES = (
    "config",
    "model.gpt",
    "generation.generate",
    "generation.sample",
    "training.optim",
    "training.precision",
)
CPU = torch.device("cpu")

Side = Callable[[], Any]


def fail(message: str) -> NoReturn:
    """Bad input: the message on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def load(rev: str) -> dict[str, Any]:
    """The baseline revision's modules, or exit 2 naming what kind of revision fits."""
    try:
        baseline = load_baseline(rev, BASELINE_MODULES)
    except (RuntimeError, ImportError) as exc:
        fail(
            f"--baseline {rev}: {str(exc).rstrip('.')}. It must be a revision with the "
            "subpackage layout whose llmcli/generation/sample.py has decode_kernels and whose "
            "Precision has backward and step, such as 5b00014."
        )
    old_api = hasattr(baseline["generation.sample"], "decode_kernels") and hasattr(
        baseline["training.precision"].Precision, "backward"
    )
    if not old_api:
        fail(
            f"--baseline {rev} has no generation.sample.decode_kernels or Precision.backward: "
            "use a revision with that API, such as 5b00014."
        )
    return baseline


def tiny_models(baseline: dict[str, Any]) -> dict[str, torch.nn.Module]:
    """The tiny model, built by each side's own code (seed 0), in eval mode."""
    today = Transformer(ModelConfig(**TINY), VOCAB, generator=torch.Generator().manual_seed(0))
    config = baseline["config"].ModelConfig(**TINY)
    old = baseline["model.gpt"].Transformer(
        config, VOCAB, generator=torch.Generator().manual_seed(0)
    )
    return {"today": today.eval(), "baseline": old.eval()}


def check_keys(baseline: dict[str, Any]) -> dict[str, Any]:
    """Whether both sides' state_dicts have the same keys (exits 2 if not: no same weights)."""
    ours, theirs = (m.state_dict() for m in tiny_models(baseline).values())
    if sorted(ours) != sorted(theirs):
        fail(
            f"the state_dict keys differ: today only {sorted(set(ours) - set(theirs))}, "
            f"baseline only {sorted(set(theirs) - set(ours))}"
        )
    return {"state_dict_keys_equal": True, "tensors": len(ours), "init_seed": 0}


def tiny_pair(baseline: dict[str, Any], scale: float = 1.0) -> dict[str, torch.nn.Module]:
    """Today's tiny model (seed 0, weight matrices times `scale`) and the baseline's holding
    the same weights (`check_keys` checked that they fit)."""
    models = tiny_models(baseline)
    if scale != 1.0:
        with torch.no_grad():
            for p in models["today"].parameters():
                if p.ndim == 2:
                    p.mul_(scale)
    models["baseline"].load_state_dict(models["today"].state_dict())
    return models


def random_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, TINY["context_length"])
    return torch.randint(VOCAB, shape, generator=g), torch.randint(VOCAB, shape, generator=g)


def interleaved(sides: dict[str, Side], rounds: int) -> dict[str, list[Any]]:
    """Each side once to warm up, then `rounds` rounds of both, today first in even rounds:
    side -> what its function returned, round by round."""
    for run in sides.values():
        run()
    results: dict[str, list[Any]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in SIDES if r % 2 == 0 else SIDES[::-1]:
            results[name].append(sides[name]())
    return results


def compared(values: dict[str, list[float]], unit: str, digits: int = 3) -> dict[str, Any]:
    """Medians per side, today / baseline (the median of the per-round ratios), every round."""
    ratios = [t / b for t, b in zip(values["today"], values["baseline"], strict=True)]
    return {
        f"{unit}_median": {name: round(statistics.median(v), digits) for name, v in values.items()},
        "today_over_baseline": round(statistics.median(ratios), 3),
        f"{unit}_rounds": {name: [round(x, digits) for x in v] for name, v in values.items()},
    }


def same_weights(models: dict[str, torch.nn.Module]) -> bool:
    ours, theirs = models["today"].state_dict(), models["baseline"].state_dict()
    return all(torch.equal(ours[k], theirs[k]) for k in ours)


class OneBatch:
    """A training stream that gives the same batch at every `next()` (a `Trainer`'s `batches`)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.batch = x, y

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch


Step = Callable[[Callable[[], None] | None], tuple[torch.Tensor, torch.Tensor]]


def today_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Step:
    """Today's training step: `train_step` on a `Trainer` (what `llmcli train` builds). The
    step's argument, if given, is called after backward with the gradients before clipping.
    The step returns its loss and gradient norm."""
    tc = TrainConfig(**TRAIN)
    optimizer = build_optimizer(model, tc, "cpu")
    precision = Precision.resolve(CPU, "float32")
    trainer = Trainer(
        model,
        list(model.parameters()),
        optimizer,
        precision,
        OneBatch(x, y),
        tc.grad_accum,
        tc.grad_clip,
    )

    def step(inspect: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        before_update = None
        if inspect is not None:

            def before_update(loss: torch.Tensor, norm: torch.Tensor) -> bool:
                inspect()
                return True  # the update goes ahead

        loss, norm, _, _ = train_step(trainer, before_update)
        return loss, norm

    return step


def baseline_step(baseline: dict[str, Any], model: torch.nn.Module, x, y) -> Step:
    """The baseline's training step, as its loop (`training.loop._train_step`) ran it for
    grad_accum 1 and no spike guard: forward under `precision.autocast()`,
    `precision.backward(loss)`, `precision.clip` (with `inspect`, called with the gradients
    before clipping), `precision.finish` (optimizer step, zero_grad)."""
    tc = baseline["config"].TrainConfig(**TRAIN)
    optimizer = baseline["training.optim"].build_optimizer(model, tc, "cpu")
    precision = baseline["training.precision"].Precision.resolve(CPU, "float32")
    params = list(model.parameters())

    def step(inspect: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        with precision.autocast():
            _, loss = model(x, y)
        loss = loss / tc.grad_accum  # the micro-batches' mean, as the loop took it
        precision.backward(loss)
        norm = precision.clip(optimizer, params, tc.grad_clip, False, inspect)
        precision.finish(optimizer)
        return loss.detach(), norm

    return step


def first_step(models: dict[str, torch.nn.Module], steps: dict[str, Step]) -> dict[str, bool]:
    """One training step of each side, untimed: are the loss, every gradient (before
    clipping) and the gradient norm equal?"""
    grads: dict[str, dict[str, torch.Tensor]] = {}
    found = {}
    for name in SIDES:

        def inspect(name: str = name) -> None:
            grads[name] = {k: p.grad.clone() for k, p in models[name].named_parameters()}

        found[name] = steps[name](inspect)
    ours, theirs = grads["today"], grads["baseline"]
    return {
        "first_loss_equal": torch.equal(found["today"][0], found["baseline"][0]),
        "first_grads_equal": ours.keys() == theirs.keys()
        and all(torch.equal(ours[k], theirs[k]) for k in ours),
        "first_grad_norm_equal": torch.equal(found["today"][1], found["baseline"][1]),
    }


def train_part(baseline: dict[str, Any], rounds: int, reps: int) -> dict[str, Any]:
    """ms per training step, each side its own step and optimizer; the same loss, gradients
    and weights after the same steps."""
    models = {name: model.train() for name, model in tiny_pair(baseline).items()}
    x, y = random_batch()
    steps = {
        "today": today_step(models["today"], x, y),
        "baseline": baseline_step(baseline, models["baseline"], x, y),
    }
    checks = first_step(models, steps)

    def side(step: Step) -> Side:
        def run() -> float:
            start = time.perf_counter()
            for _ in range(reps):
                step(None)
            return (time.perf_counter() - start) / reps * 1e3

        return run

    ms = interleaved({name: side(step) for name, step in steps.items()}, rounds)
    # Both sides took the same number of steps from the same weights on the same batch.
    return {**compared(ms, "ms"), **checks, "weights_equal_after_steps": same_weights(models)}


def forward(baseline: dict[str, Any], rounds: int, reps: int) -> dict[str, Any]:
    """ms per inference forward of the batch; the logits equal bit for bit."""
    models = tiny_pair(baseline)
    x, _ = random_batch()
    with torch.no_grad():
        logits = {name: model(x)[0] for name, model in models.items()}

    def side(model: torch.nn.Module) -> Side:
        def run() -> float:
            with torch.no_grad():
                start = time.perf_counter()
                for _ in range(reps):
                    model(x)
                return (time.perf_counter() - start) / reps * 1e3

        return run

    ms = interleaved({name: side(model) for name, model in models.items()}, rounds)
    return {**compared(ms, "ms"), "logits_equal": torch.equal(logits["today"], logits["baseline"])}


def stepped(start: Callable[[], Iterator[torch.Tensor]]) -> tuple[list[int], list[float]]:
    """Start a generation and run it: its tokens (row 0) and the seconds of each step (the
    first counts from before `start`, so a decoder built there is part of it)."""
    stamps, tokens = [time.perf_counter()], []
    for ids in start():
        tokens.append(int(ids[0]))
        stamps.append(time.perf_counter())
    return tokens, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def sampler(
    baseline: dict[str, Any], models: dict[str, torch.nn.Module], n: int, settings: dict
) -> dict[str, Callable[[], tuple[list[int], list[float]]]]:
    """One batch-1 generation of `n` tokens from the prompt [1] per side, as each side's
    `llmcli sample` runs it: today's with `FastDecoder`, the baseline's inside its
    `decode_kernels`."""
    config = SampleConfig(max_new_tokens=n, **settings)
    old_config = baseline["config"].SampleConfig(max_new_tokens=n, **settings)
    old_generate = baseline["generation.generate"].generate
    decode_kernels = baseline["generation.sample"].decode_kernels
    model, old = models["today"], models["baseline"]

    def today() -> tuple[list[int], list[float]]:
        return stepped(lambda: generate(model, [[1]], config, decode=FastDecoder.for_model(model)))

    def baseline_side() -> tuple[list[int], list[float]]:
        with decode_kernels(old, old_config, 1):
            return stepped(lambda: old_generate(old, [[1]], old_config))

    return {"today": today, "baseline": baseline_side}


def decode_step(baseline: dict[str, Any], rounds: int) -> dict[str, Any]:
    """ms per cached in-context step (a run's median after its first two), greedy and sampled."""
    models = tiny_pair(baseline, scale=4.0)
    n = TINY["context_length"] - 1
    out: dict[str, Any] = {"new_tokens": n, "prompt_tokens": 1}
    for label, settings in {"greedy": {"temperature": 0.0}, "sampled": SAMPLED}.items():
        runs = interleaved(sampler(baseline, models, n, settings), rounds)
        ms = {name: [statistics.median(per[2:]) * 1e3 for _, per in v] for name, v in runs.items()}
        first = runs["today"][0][0]
        out[label] = {
            **compared(ms, "ms", digits=4),
            "tokens_equal": all(tokens == first for v in runs.values() for tokens, _ in v),
        }
    return out


def fast_vs_forward(baseline: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Today's opt-in decode step (`FastDecoder`) against today's plain loop (every step the
    model's forward), both today's code: ms per cached in-context step, sampled; what justifies
    keeping the faster step."""
    model = tiny_pair(baseline, scale=4.0)["today"]
    config = SampleConfig(max_new_tokens=TINY["context_length"] - 1, **SAMPLED)

    def side(decode: bool) -> Side:
        def run() -> tuple[list[int], list[float]]:
            made = FastDecoder.for_model(model) if decode else None
            return stepped(lambda: generate(model, [[1]], config, decode=made))

        return run

    runs = interleaved({"today": side(True), "baseline": side(False)}, rounds)
    ms = {name: [statistics.median(per[2:]) * 1e3 for _, per in v] for name, v in runs.items()}
    first = runs["today"][0][0]
    result = compared(ms, "ms", digits=4)
    return {
        "sides": {"today": "FastDecoder", "baseline": "the model's forward (plain loop)"},
        "fast_over_forward": result.pop("today_over_baseline"),
        **result,
        "tokens_equal": all(tokens == first for v in runs.values() for tokens, _ in v),
    }


def long_sample(baseline: dict[str, Any], rounds: int, n: int) -> dict[str, Any]:
    """Tokens/s of `n` sampled tokens past the context under `shift`; the same tokens."""
    models = tiny_pair(baseline, scale=4.0)
    runs = interleaved(sampler(baseline, models, n, {**SAMPLED, "context_policy": "shift"}), rounds)
    rate = {name: [n / sum(per) for _, per in v] for name, v in runs.items()}
    first = runs["today"][0][0]
    return {
        "new_tokens": n,
        "policy": "shift",
        **compared(rate, "tokens_per_s", digits=1),
        "tokens_equal": all(tokens == first for v in runs.values() for tokens, _ in v),
    }


def machine() -> dict[str, Any]:
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg_start": [round(v, 2) for v in os.getloadavg()],
    }


def ratios(out: dict[str, Any]) -> dict[str, float]:
    """Every part's today / baseline, by name and unit."""
    found = {}
    for part in ("train_step", "forward"):
        if part in out:
            found[f"{part}_ms"] = out[part]["today_over_baseline"]
    for label in ("greedy", "sampled"):
        if "decode_step" in out:
            found[f"decode_step_{label}_ms"] = out["decode_step"][label]["today_over_baseline"]
    if "fast_vs_forward" in out:
        found["fast_decode_over_forward_ms"] = out["fast_vs_forward"]["fast_over_forward"]
    if "long_sample" in out:
        found["long_sample_tokens_per_s"] = out["long_sample"]["today_over_baseline"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="5b00014", help="git revision to compare with")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the fast parts")
    parser.add_argument("--reps", type=int, default=10, help="steps / forwards per round")
    parser.add_argument("--long-rounds", type=int, default=3, help="rounds of long_sample")
    parser.add_argument("--long-tokens", type=int, default=2000, help="long_sample's new tokens")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"any of {', '.join(PARTS)}")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if unknown := parts - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}: choose among {', '.join(PARTS)}")
    torch.set_num_threads(args.threads)
    started, info = time.perf_counter(), machine()
    baseline = load(args.baseline)
    out: dict[str, Any] = {"benchmark": "model_speed", "ratios": {}}
    weights = check_keys(baseline)
    if "train" in parts:
        out["train_step"] = train_part(baseline, args.rounds, args.reps)
    if "forward" in parts:
        out["forward"] = forward(baseline, args.rounds, args.reps)
    if "decode" in parts:
        out["decode_step"] = decode_step(baseline, args.rounds)
    if "fast" in parts:
        out["fast_vs_forward"] = fast_vs_forward(baseline, args.rounds)
    if "long" in parts:
        out["long_sample"] = long_sample(baseline, args.long_rounds, args.long_tokens)
    out["ratios"] = ratios(out)
    out["weights"] = weights
    out["settings"] = {
        "baseline": {"requested": args.baseline, "rev": baseline["rev"]},
        "model": {**TINY, "vocab_size": VOCAB, "batch_size": BATCH},
        "train": TRAIN,
        "sampled": SAMPLED,
        "threads": args.threads,
        "rounds": args.rounds,
        "reps": args.reps,
        "long_rounds": args.long_rounds,
    }
    out["machine"] = {**info, "load_avg_end": [round(v, 2) for v in os.getloadavg()]}
    out["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
