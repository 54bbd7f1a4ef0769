"""Inspection outputs bit for bit: today's code against a baseline revision's, on a trained run.

    python benchmarks/inspection_bits.py [--run checkpoints/tiny] [--baseline 5b00014]
        [--batches 2] [--eval-steps 2] [--ablate L.H,L]

Both sides load the run (`--run`, a trained run such as `llmcli train tiny` writes) through their
own `load_run` (`weights`: the same tensors), and read their inputs through their own code: the
token ids of the run's validation split (`eval_tokens`, `eval_data`: the same ids) and, for the
ablation, its windows (`window_starts`, `window_batches`: the same batches). Compared, every
value bit for bit:

- `attention`: what `llmcli inspect-attention` dumps, for prompts of several lengths (the whole
  context, about half of it, 8 tokens and 1) captured together in one right-padded batch:
  `capture_prompts` (`llmcli.inspection.capture`): every logit and attention weight; and
  `build_dumps` (`llmcli.inspection.attention`, with the induction columns: the prompt's own
  repeats and the fixed probe): each dump's weights, metrics, metric names, tokens, token ids
  and meta.
- `ablation`: every head's Δloss, zero and mean ablation, on the first `--batches` validation
  batches of the run's batch size: `head_deltas` (the layer cache) and `head_deltas_full` (one
  full forward per head; `llmcli.inspection.ablation`); the base loss and every Δloss.
- `eval_ablate`: `llmcli eval --ablate` (`evaluate_run` with `ablate=--ablate`, zero and mean,
  and without ablation) on the first `--eval-steps` batches: the loss, and the perplexity, bits
  per token and byte, tokens, bytes and windows with it.

Today's side is the working tree's (the evaluation in `llmcli.evaluation.run` and
`llmcli.evaluation.text`); the baseline's, its revision's own modules (`runs.loading`,
`inspection.capture`, `inspection.attention`, `inspection.ablation`, and its evaluation:
`inspection.evaluate`, or `evaluation.text` and `evaluation.run` from 8bdabf1 on), so
`--baseline` must be a revision that has them, such as 5b00014 or 8bdabf1. Each comparison
reports `equal` and `max_abs_diff`; `all_equal` sums them up. Everything runs on the CPU.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from git_baseline import fail, has_file, load_run_sides

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.errors import InputError  # noqa: E402
from llmcli.evaluation import run as evaluation  # noqa: E402
from llmcli.evaluation import text  # noqa: E402
from llmcli.inspection import ablation, attention, capture  # noqa: E402

BASELINE_MODULES = (
    "runs.loading",
    "inspection.capture",
    "inspection.attention",
    "inspection.ablation",
)
# Where a revision keeps `eval_tokens`, `window_starts`, `window_batches` and `evaluate_run`: in
# `inspection.evaluate` before evaluation had a package of its own (5b00014), in
# `evaluation.text` and `evaluation.run` since (8bdabf1 and later).
OLD_EVALUATION, EVALUATION = ("inspection.evaluate",), ("evaluation.text", "evaluation.run")
METHODS = ("zero", "mean")
EVAL_FIELDS = (
    "loss",
    "perplexity",
    "bits_per_token",
    "bits_per_byte",
    "tokens",
    "bytes",
    "windows",
)


def load_sides(run_dir: Path, rev: str) -> tuple[Any, Any, dict[str, Any]]:
    """Today's loaded run, the baseline's loaded run, the baseline's modules (or exit 2); the
    baseline's evaluation under "inspection.evaluate" whichever modules hold it."""
    old_layout = has_file(rev, "llmcli/inspection/evaluate.py")
    modules = BASELINE_MODULES + (OLD_EVALUATION if old_layout else EVALUATION)
    today, old, baseline = load_run_sides(run_dir, rev, modules)
    if not old_layout:
        parts = {**vars(baseline["evaluation.text"]), **vars(baseline["evaluation.run"])}
        baseline["inspection.evaluate"] = SimpleNamespace(**parts)
    return today, old, baseline


def compare(ours: Any, theirs: Any) -> dict[str, Any]:
    """Whether two values (numbers, tensors, arrays, or lists of them) are equal bit for bit
    (NaN where both have NaN counts as equal), and their largest absolute difference (None where
    the shapes differ or only one side has NaN)."""
    if isinstance(ours, (list, tuple)):
        if len(ours) != len(theirs):
            return {"equal": False, "max_abs_diff": None}
        parts = [compare(a, b) for a, b in zip(ours, theirs, strict=True)]
        diffs = [p["max_abs_diff"] for p in parts]
        return {
            "equal": all(p["equal"] for p in parts),
            "max_abs_diff": None if None in diffs else max(diffs, default=0.0),
        }
    a = np.asarray(ours.numpy() if isinstance(ours, torch.Tensor) else ours)
    b = np.asarray(theirs.numpy() if isinstance(theirs, torch.Tensor) else theirs)
    if a.shape != b.shape:
        return {"equal": False, "max_abs_diff": None}
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    diff = np.where(np.isnan(a64) & np.isnan(b64), 0.0, np.abs(a64 - b64))
    worst = None if np.isnan(diff).any() else float(diff.max(initial=0.0))
    return {"equal": a.dtype == b.dtype and a.tobytes() == b.tobytes(), "max_abs_diff": worst}


def same_weights(today: Any, old: Any) -> dict[str, Any]:
    """Whether both sides loaded the same tensors under the same names."""
    ours, theirs = today.model.state_dict(), old.model.state_dict()
    if sorted(ours) != sorted(theirs):
        return {"equal": False, "max_abs_diff": None, "keys_equal": False}
    return compare([ours[k] for k in sorted(ours)], [theirs[k] for k in sorted(ours)])


def prompt_ids(tokens: np.ndarray, context_length: int) -> list[list[int]]:
    """Validation slices of several lengths (the whole context, about half, 8 tokens, 1), each
    from its own offset, longest first: prompts that share one padded batch."""
    lengths = sorted({context_length, context_length // 2 + 1, min(8, context_length), 1})
    return [
        [int(t) for t in tokens[i * context_length : i * context_length + n]]
        for i, n in enumerate(reversed(lengths))
    ]


def attention_dumps(today: Any, old: Any, baseline: dict, prompts: list) -> dict[str, Any]:
    """Capture and dumps of `inspect-attention` (with the induction columns) for the prompts,
    both sides."""
    ours = capture.capture_prompts(today.model, prompts)
    theirs = baseline["inspection.capture"].capture_prompts(old.model, prompts)
    old_attention = baseline["inspection.attention"]
    dumps = attention.build_dumps(
        today.model,
        today.tokenizer,
        [],
        attention.InspectOptions(induction=True),
        prompts_ids=prompts,
    )
    old_dumps = old_attention.build_dumps(
        old.model,
        old.tokenizer,
        [],
        old_attention.InspectOptions(induction=True),
        prompts_ids=prompts,
    )
    return {
        "prompt_lengths": [len(ids) for ids in prompts],
        "logits": compare([lg for lg, _ in ours], [lg for lg, _ in theirs]),
        "weights": compare([w for _, w in ours], [w for _, w in theirs]),
        "dump_weights": compare([d.attn for d in dumps], [d.attn for d in old_dumps]),
        "dump_metrics": compare([d.metrics for d in dumps], [d.metrics for d in old_dumps]),
        "dump_metric_names": dumps[0].metric_names,
        "dump_metric_names_equal": [d.metric_names for d in dumps]
        == [d.metric_names for d in old_dumps],
        "dump_tokens_equal": [d.tokens for d in dumps] == [d.tokens for d in old_dumps],
        "dump_token_ids": compare([d.token_ids for d in dumps], [d.token_ids for d in old_dumps]),
        "dump_meta_equal": [d.meta for d in dumps] == [d.meta for d in old_dumps],
    }


def validation_batches(run: Any, tokens: np.ndarray, n: int, evaluate: Any) -> list:
    """The first `n` validation batches of the run's batch size, by `evaluate`'s own
    `window_starts` and `window_batches`."""
    ctx, batch_size = run.config.model.context_length, run.config.train.batch_size
    starts = evaluate.window_starts(len(tokens), ctx, batch_size, n)
    return list(evaluate.window_batches(tokens, ctx, starts, "cpu"))


def head_ablation(today: Any, old: Any, baseline: dict, tokens: dict, n: int) -> dict:
    """`head_deltas` and `head_deltas_full`, zero and mean, on the first `n` validation batches
    (each side's own)."""
    batches = validation_batches(today, tokens["today"], n, text)
    old_batches = validation_batches(old, tokens["baseline"], n, baseline["inspection.evaluate"])
    out: dict[str, Any] = {
        "batches": len(batches),
        "batch_size": today.config.train.batch_size,
        "batches_tokens": compare(
            [t for xy in batches for t in xy], [t for xy in old_batches for t in xy]
        ),
    }
    for name in ("head_deltas", "head_deltas_full"):
        ours = getattr(ablation, name)(today.model, batches, METHODS)
        theirs = getattr(baseline["inspection.ablation"], name)(old.model, old_batches, METHODS)
        out[name] = {
            "base_loss": {"today": ours.base_loss, **compare(ours.base_loss, theirs.base_loss)},
            **{m: compare(ours.delta[m], theirs.delta[m]) for m in METHODS},
        }
    return out


def eval_ablate(run_dir: Path, baseline: dict, specs: list[str], steps: int) -> dict[str, Any]:
    """`llmcli eval` with the heads `specs` removed (zero, mean) and without: the loss and the
    figures with it."""
    old_evaluate = baseline["inspection.evaluate"]
    out: dict[str, Any] = {"ablate": specs, "steps": steps}
    for method in (None, *METHODS):
        kwargs: dict[str, Any] = {"steps": steps, "device": "cpu"}
        if method is not None:
            kwargs |= {"ablate": tuple(specs), "ablation": method}
        ours = evaluation.evaluate_run(run_dir, None, evaluation.EvalOptions(**kwargs))
        theirs = old_evaluate.evaluate_run(run_dir, None, old_evaluate.EvalOptions(**kwargs))
        out[method or "none"] = {
            "today": ours.loss,
            "baseline": theirs.loss,
            **compare(
                [getattr(ours, f) for f in EVAL_FIELDS], [getattr(theirs, f) for f in EVAL_FIELDS]
            ),
        }
    return out


def all_equal(found: Any) -> bool:
    """Every `equal` and `*_equal` flag in `found` is true."""
    if isinstance(found, dict):
        return all(
            value is True if key == "equal" or key.endswith("_equal") else all_equal(value)
            for key, value in found.items()
        )
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=str(ROOT / "checkpoints" / "tiny"), help="a trained run")
    parser.add_argument("--baseline", default="5b00014", help="git revision to compare with")
    parser.add_argument("--batches", type=int, default=2, help="validation batches to ablate on")
    parser.add_argument("--eval-steps", type=int, default=2, help="batches `eval --ablate` scores")
    parser.add_argument(
        "--ablate", default=None, help="eval's heads to remove, L.H or L (default: 0.H-1,L-1)"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    run_dir = Path(args.run)
    today, old, baseline = load_sides(run_dir, args.baseline)
    model = today.model
    specs = (args.ablate or f"0.{model.n_head - 1},{model.n_layer - 1}").split(",")
    try:
        tokens, label = text.eval_tokens(today)
        old_tokens, old_label = baseline["inspection.evaluate"].eval_tokens(old)
        found = {
            "weights": same_weights(today, old),
            "eval_data": {**compare(tokens, old_tokens), "label_equal": label == old_label},
            "attention": attention_dumps(
                today, old, baseline, prompt_ids(tokens, model.context_length)
            ),
            "ablation": head_ablation(
                today, old, baseline, {"today": tokens, "baseline": old_tokens}, args.batches
            ),
            "eval_ablate": eval_ablate(run_dir, baseline, specs, args.eval_steps),
        }
    except InputError as exc:
        fail(str(exc))
    out = {
        "benchmark": "inspection_bits",
        "all_equal": all_equal(found),
        **found,
        "run": str(run_dir),
        "step": today.step,
        "data": label,
        "baseline": {"requested": args.baseline, "rev": baseline["rev"]},
        "machine": {"python": platform.python_version(), "torch": torch.__version__},
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
