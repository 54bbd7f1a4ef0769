"""Inspection outputs bit for bit: today's code against a baseline revision's, on a trained run.

    python benchmarks/inspection_bits.py [--run checkpoints/tiny] [--baseline 4558fb4]
        [--batches 2] [--eval-steps 2] [--ablate L.H,L]

Issue 25 rewrote capture and ablation on the model's hook points and promised the same outputs.
Both sides load the run (`--run`, a trained run such as `llmcli train tiny` writes) through their
own `load_run`, and get the same inputs: token ids from the run's validation split. Compared,
every value bit for bit:

- `attention`: what `llmcli inspect-attention` dumps, for prompts of several lengths (the whole
  context, about half of it, 8 tokens and 1) captured together in one right-padded batch:
  `capture_prompts` (today `llmcli.inspection.capture`, baseline `attention.capture`): every
  logit and attention weight; and `build_dumps` (today `llmcli.inspection.attention`, baseline
  `attention.report`): each dump's weights, metrics and tokens (without the induction columns,
  which issue 26 changed on purpose: the probe and the prompt's own repeats).
- `ablation`: every head's Δloss, zero and mean ablation, on the first `--batches` validation
  batches of the run's batch size: `head_deltas` (the layer cache) and `head_deltas_full` (one
  full forward per head; today `llmcli.inspection.ablation`, baseline `ablation`); the base
  loss and every Δloss.
- `eval_ablate`: `llmcli eval --ablate` (`evaluate_run` with `ablate=--ablate`, zero and mean,
  and without ablation; today `llmcli.inspection.evaluate`, baseline `evaluate`) on the first
  `--eval-steps` batches: the loss.

Each comparison reports `equal` and `max_abs_diff`; `all_equal` sums them up. The baseline
side calls its revision's own API, so `--baseline` must be a revision with the flat package
layout, from before the subpackages (5c34e45). Everything runs on the CPU.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from git_baseline import load_baseline

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.errors import CheckpointError, InputError  # noqa: E402
from llmcli.inspection import ablation, attention, capture, evaluate  # noqa: E402
from llmcli.runs.loading import load_run  # noqa: E402

BASELINE_MODULES = ("checkpoint", "attention.capture", "attention.report", "ablation", "evaluate")
METHODS = ("zero", "mean")


def fail(message: str) -> NoReturn:
    """Bad input: the message on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def load_sides(run_dir: Path, rev: str) -> tuple[Any, Any, dict[str, Any]]:
    """Today's loaded run, the baseline's loaded run, the baseline's modules (or exit 2)."""
    if not (run_dir / "config.yaml").is_file():
        fail(f"no trained run at {run_dir}: run `llmcli train tiny` first, or pass --run DIR.")
    try:
        today = load_run(run_dir, device="cpu")
    except CheckpointError as exc:
        fail(str(exc))
    try:
        baseline = load_baseline(rev, BASELINE_MODULES)
    except (RuntimeError, ImportError) as exc:
        fail(
            f"--baseline {rev}: {str(exc).rstrip('.')}. It must be a revision with the flat "
            "package layout (llmcli/checkpoint.py, llmcli/ablation.py), from before 5c34e45."
        )
    return today, baseline["checkpoint"].load_run(run_dir, device="cpu"), baseline


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
    """Capture and dumps of `inspect-attention` for the prompts, both sides."""
    ours = capture.capture_prompts(today.model, prompts)
    theirs = baseline["attention.capture"].capture_prompts(old.model, prompts)
    options = attention.InspectOptions()
    dumps = attention.build_dumps(today.model, today.tokenizer, [], options, prompts_ids=prompts)
    old_dumps = baseline["attention.report"].build_dumps(
        old.model, old.tokenizer, [], prompts_ids=prompts, induction=False
    )
    return {
        "prompt_lengths": [len(ids) for ids in prompts],
        "logits": compare([lg for lg, _ in ours], [lg for lg, _ in theirs]),
        "weights": compare([w for _, w in ours], [w for _, w in theirs]),
        "dump_weights": compare([d.attn for d in dumps], [d.attn for d in old_dumps]),
        "dump_metrics": compare([d.metrics for d in dumps], [d.metrics for d in old_dumps]),
        "dump_metric_names_equal": [d.metric_names for d in dumps]
        == [d.metric_names for d in old_dumps],
        "dump_tokens_equal": [d.tokens for d in dumps] == [d.tokens for d in old_dumps],
    }


def head_ablation(today: Any, old: Any, baseline: dict, tokens: np.ndarray, n: int) -> dict:
    """`head_deltas` and `head_deltas_full`, zero and mean, on the first `n` validation batches."""
    ctx, batch_size = today.config.model.context_length, today.config.train.batch_size
    starts = evaluate.window_starts(len(tokens), ctx, batch_size, n)
    batches = list(evaluate.window_batches(tokens, ctx, starts, "cpu"))
    out: dict[str, Any] = {"batches": len(batches), "batch_size": batch_size}
    for name in ("head_deltas", "head_deltas_full"):
        ours = getattr(ablation, name)(today.model, batches, METHODS)
        theirs = getattr(baseline["ablation"], name)(old.model, batches, METHODS)
        out[name] = {
            "base_loss": {"today": ours.base_loss, **compare(ours.base_loss, theirs.base_loss)},
            **{m: compare(ours.delta[m], theirs.delta[m]) for m in METHODS},
        }
    return out


def eval_ablate(run_dir: Path, baseline: dict, specs: list[str], steps: int) -> dict[str, Any]:
    """`llmcli eval` with the heads `specs` removed (zero, mean) and without: the losses."""
    out: dict[str, Any] = {"ablate": specs, "steps": steps}
    for method in (None, *METHODS):
        kwargs = {"steps": steps, "device": "cpu"}
        if method is not None:
            kwargs |= {"ablate": specs, "ablation": method}
        ours = evaluate.evaluate_run(run_dir, None, evaluate.EvalOptions(**kwargs)).loss
        theirs = baseline["evaluate"].evaluate_run(run_dir, **kwargs).loss
        out[method or "none"] = {"today": ours, "baseline": theirs, **compare(ours, theirs)}
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
    parser.add_argument("--baseline", default="4558fb4", help="git revision to compare with")
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
        tokens, label = evaluate.eval_tokens(today)
        found = {
            "weights": same_weights(today, old),
            "attention": attention_dumps(
                today, old, baseline, prompt_ids(tokens, model.context_length)
            ),
            "ablation": head_ablation(today, old, baseline, tokens, args.batches),
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
