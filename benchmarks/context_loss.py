"""Validation loss by context length, and the loss each context policy's lengths give; JSON.

Past `context_length` the two policies of `llmcli sample` let the model see different numbers
of tokens: `exact` always the last `context_length`; `shift` between `keep` and
`context_length` (`keep` right after a re-prefill, one more at each step up to the full
context). In both, a prediction from `L` tokens is the model run on a window of `L` tokens at
positions `0 .. L - 1`. So this scores the run's validation split at every length: consecutive
windows of `context_length + 1` tokens, position `i` of a window predicted from exactly its
`i + 1` tokens before, gives `loss(L)` for `L = 1 .. context_length`. Each policy's figure is the
mean of `loss(L)` over the lengths it uses:

- `steady`: far past the context (`exact`: `loss(C)`; `shift`: the mean of `loss(keep .. C)`);
- `sample_N`: a whole `llmcli sample` of `N` new tokens from an empty prompt (1 token), with the
  lengths of every step (the first window is the same for both policies).

In those windows each length scores its own tokens (position `i` of every window), so two
lengths' figures differ by which tokens they saw as well as by the context. `paired` removes
that: one random set of target tokens, each predicted from its last `L` tokens for every `L`
(`--paired N` targets, seeded), and the steady-state difference `shift - exact` per target with
its standard error.

Usage: python benchmarks/context_loss.py [--run checkpoints/tiny] [--keeps 16,32,48]
       [--batch-size 64] [--paired 2000] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmcli.config import default_keep  # noqa: E402
from llmcli.data.tokens import prepare_data  # noqa: E402
from llmcli.evaluation.text import window_batches, window_starts  # noqa: E402
from llmcli.runs.loading import load_run  # noqa: E402


@torch.inference_mode()
def loss_by_length(model: torch.nn.Module, tokens: np.ndarray, batch_size: int) -> list[float]:
    """Mean cross-entropy (nats) of a prediction from `L` tokens, for `L = 1 .. C`."""
    C = model.context_length
    totals, n_windows = torch.zeros(C, dtype=torch.float64), 0
    for x, y in window_batches(tokens, C, window_starts(len(tokens), C, batch_size), "cpu"):
        if x.shape[1] < C:  # the shorter last window: every length is scored on full ones
            continue
        logits, _ = model(x)  # (b, C, V)
        ce = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # (b, C)
        totals += ce.double().sum(dim=0)
        n_windows += x.shape[0]
    return (totals / n_windows).tolist()


@torch.inference_mode()
def paired_losses(
    model: torch.nn.Module, tokens: np.ndarray, n_targets: int, batch_size: int, seed: int = 0
) -> torch.Tensor:
    """Cross-entropy `(C, N)` of `N` random target tokens, each predicted from exactly its
    `L` tokens before (a window of its own at positions `0 .. L - 1`), for `L = 1 .. C`."""
    C = model.context_length
    rng = np.random.default_rng(seed)
    n = min(n_targets, len(tokens) - C)
    targets = torch.from_numpy(np.sort(rng.choice(np.arange(C, len(tokens)), n, replace=False)))
    data = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    out = torch.zeros(C, n, dtype=torch.float64)
    for L in range(1, C + 1):
        offsets = torch.arange(-L, 0)  # (L,)
        for first in range(0, n, batch_size):
            t = targets[first : first + batch_size]  # (b,)
            logits, _ = model(data[t[:, None] + offsets])  # (b, L) -> (b, L, V)
            ce = F.cross_entropy(logits[:, -1, :], data[t], reduction="none")  # (b,)
            out[L - 1, first : first + len(t)] = ce.double()
    return out


def paired_policies(ce: torch.Tensor, keeps: list[int]) -> dict:
    """Steady-state `exact` and `shift` losses on the same targets, and their difference."""
    C, n = ce.shape
    out = {}
    for keep in keeps:
        exact, shift = ce[C - 1], ce[keep - 1 :].mean(dim=0)  # (n,) each
        diff = shift - exact
        out[f"keep_{keep}"] = {
            "exact": round(exact.mean().item(), 4),
            "shift": round(shift.mean().item(), 4),
            "shift_minus_exact": round(diff.mean().item(), 4),
            "standard_error": round(diff.std().item() / math.sqrt(n), 4),
        }
    return out


def lengths(policy: str, n: int, C: int, keep: int, prompt: int = 1) -> list[int]:
    """Tokens the model sees at each of `n` steps after a `prompt`-token prompt."""
    out, seen = [], prompt
    for _ in range(n):
        if seen > C:
            seen = C if policy == "exact" else keep
        out.append(seen)
        seen += 1
    return out


def policy_losses(by_length: list[float], C: int, keep: int, samples: list[int]) -> dict:
    def mean_over(ls: list[int]) -> float:
        return round(statistics.fmean(by_length[L - 1] for L in ls), 4)

    out = {}
    for policy in ("exact", "shift"):
        steady = [C] if policy == "exact" else list(range(keep, C + 1))
        row = {"steady": mean_over(steady)}
        for n in samples:
            row[f"sample_{n}"] = mean_over(lengths(policy, n, C, keep))
        row["mean_context"] = round(statistics.fmean(steady), 1)
        out[policy] = row
    return out


def paired(model: torch.nn.Module, tokens: np.ndarray, n_targets: int, keeps: list[int]) -> dict:
    ce = paired_losses(model, tokens, n_targets, batch_size=256)  # (C, N)
    return {
        "targets": ce.shape[1],
        "loss_by_length": [round(x, 4) for x in ce.mean(dim=1).tolist()],
        "policies": paired_policies(ce, keeps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="checkpoints/tiny")
    parser.add_argument("--keeps", default=None, help="keep sizes (default: C/4, C/2, 3C/4)")
    parser.add_argument("--samples", default="500,2000", help="new tokens per sample")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--paired", type=int, default=2000, help="paired targets (0: none)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    run = load_run(args.run, device=torch.device("cpu"))
    C = run.model.context_length
    tokens = prepare_data(run.config.data, C, tokenizer=run.tokenizer).val
    by_length = loss_by_length(run.model, tokens, args.batch_size)
    keeps = (
        [int(k) for k in args.keeps.split(",")]
        if args.keeps
        else sorted({max(1, C // 4), default_keep(C), 3 * C // 4})
    )
    samples = [int(n) for n in args.samples.split(",")]
    result = {
        "run": str(run.run_dir),
        "step": run.step,
        "model": run.config.model.__dict__,
        "val_tokens": len(tokens),
        "windows": (len(tokens) - 1) // C,
        "loss_by_length": [round(x, 4) for x in by_length],
        "loss_all_positions": round(statistics.fmean(by_length), 4),
        "policies": {f"keep_{keep}": policy_losses(by_length, C, keep, samples) for keep in keeps},
        "default_keep": default_keep(C),
        "paired": paired(run.model, tokens, args.paired, keeps) if args.paired else None,
        "machine": {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    assert all(math.isfinite(x) for x in by_length)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
