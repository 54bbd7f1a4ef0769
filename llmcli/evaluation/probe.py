"""The fixed probe of repeated random tokens, and every head's scores on it.

Olsson et al. (2022) find induction heads by running a model on random tokens that repeat: on
the second copy, an induction head attends to the token after the earlier occurrence of the
current one (and the model then predicts it), a duplicate-token head to that occurrence itself,
and a previous-token head, the first half of the induction circuit, to the token just before.
Random tokens leave nothing else to predict them by, so the scores measure the mechanism, not
the text. `inspect-attention --induction` prints the probe's induction score (`probe_induction`)
beside the prompt's own, and training logs all three scores at every evaluation with
`train.head_metrics`. The probe is fixed (seeded) for a tokenizer and a context length, so the
scores of two checkpoints of a run compare.

What the probe is made of:

- `PROBE_SEQUENCES` sequences, each `period` random tokens followed by the same tokens again;
- no special token (end-of-text) and no separator (whitespace: a newline joins the documents of
  a char corpus), which a model reads as a boundary, not as a token to copy;
- no token twice within a copy: the period is at most the number of tokens left (and
  `context_length // 2` and `PROBE_MAX_PERIOD`), so every query of the second copy has exactly
  one earlier occurrence; the induction and duplicate-token scores count only such unambiguous
  queries (`unique=True`), where an ideal head scores 1.

Every layer's weights are read at its `blocks.{l}.attn.pattern` hook point and scored there, on
the model's device, so no more than one layer's weights are held at a time and only the scores
leave the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from llmcli.evaluation.repeats import earlier_occurrences

#: Repeated random sequences in the probe.
PROBE_SEQUENCES = 8
#: The probe's seed: fixed, so every evaluation of every run sees the same sequences.
PROBE_SEED = 0
#: The longest copy: longer copies only cost time (the weights grow with the square).
PROBE_MAX_PERIOD = 128
#: The per-head scores on the probe, in the order `ProbeScores.grids` gives them.
PROBE_SCORES: tuple[str, ...] = ("prev_token", "induction", "duplicate_token")


def probe_token_ids(tokenizer: Any) -> list[int]:
    """The ids the probe draws from: every token but the special ones (the end-of-text token and
    a Hugging Face tokenizer's special added tokens) and those that decode to whitespace only
    (separators: a newline joins documents in a char corpus). All ids if fewer than two are left.
    """
    vocab = int(tokenizer.vocab_size)
    special = {tokenizer.eot_id} if tokenizer.eot_id is not None else set()
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:  # a BPETokenizer: any Hugging Face tokenizer.json
        special |= {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        texts = hf.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    else:
        texts = [tokenizer.decode([i]) for i in range(vocab)]
    ids = [i for i, text in enumerate(texts) if i not in special and text.strip()]
    return ids if len(ids) >= 2 else list(range(vocab))


def repeated_random_tokens(
    pool: Sequence[int], period: int, batch: int, generator: torch.Generator
) -> torch.Tensor:
    """Random sequences of `period` tokens from `pool`, each followed by itself: `(batch, 2 *
    period)` ids.

    Each copy is drawn without replacement; a pool smaller than `period` is drawn whole, again
    and again (each token then repeats as little as it can, and `unique` scoring skips the
    queries it makes ambiguous).
    """
    pool_t = torch.as_tensor(list(pool), dtype=torch.long)
    rounds = -(-period // len(pool_t))  # ceil
    rows = []
    for _ in range(batch):
        draws = [torch.randperm(len(pool_t), generator=generator) for _ in range(rounds)]
        row = pool_t[torch.cat(draws)[:period]]  # (period,)
        rows.append(torch.cat([row, row]))
    return torch.stack(rows)  # (batch, 2 * period)


@dataclass(frozen=True)
class Probe:
    """The probe's token ids `(sequences, 2 * period)` and how they were drawn."""

    tokens: torch.Tensor
    period: int
    seed: int
    pool_size: int  # how many token ids it draws from

    def describe(self) -> dict[str, Any]:
        """What a dump's meta and `head_metrics.jsonl` record about the probe."""
        return {
            "sequences": len(self.tokens),
            "period": self.period,
            "seed": self.seed,
            "pool_size": self.pool_size,
        }


def make_probe(
    tokenizer: Any,
    context_length: int,
    *,
    sequences: int = PROBE_SEQUENCES,
    seed: int = PROBE_SEED,
) -> Probe:
    """The fixed probe for a tokenizer and a context length (see the module doc)."""
    pool = probe_token_ids(tokenizer)
    period = max(1, min(context_length // 2, len(pool), PROBE_MAX_PERIOD))
    gen = torch.Generator().manual_seed(seed)  # its own generator: no global RNG is touched
    tokens = repeated_random_tokens(pool, period, sequences, gen)
    return Probe(tokens=tokens, period=period, seed=seed, pool_size=len(pool))


@dataclass
class ProbeScores:
    """Every head's scores on the probe, each `[n_layer, n_head]`, averaged over its sequences."""

    prev_token: np.ndarray
    induction: np.ndarray
    duplicate_token: np.ndarray

    def grids(self) -> dict[str, list[list[float]]]:
        """The grids as nested lists, by `PROBE_SCORES` name (JSON-ready)."""
        return {name: getattr(self, name).tolist() for name in PROBE_SCORES}

    def summary(self) -> dict[str, float]:
        """The strongest head's score of each kind: `induction_max`, `prev_token_max`."""
        return {
            "induction_max": float(np.nanmax(self.induction)),
            "prev_token_max": float(np.nanmax(self.prev_token)),
        }


def unambiguous_pairs(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The queries whose token occurred exactly once before, and that earlier position.

    Args:
        tokens: ids `[S, T]`.

    Returns:
        `(sequence, query, earlier)` index arrays, one entry per such query.
    """
    seqs, queries, earlier = [], [], []
    for s, ids in enumerate(tokens):
        before = earlier_occurrences(ids)  # (T, T)
        (q,) = np.nonzero(before.sum(-1) == 1)
        seqs.append(np.full(len(q), s))
        queries.append(q)
        earlier.append(before[q].argmax(-1))  # the one earlier occurrence of each
    return np.concatenate(seqs), np.concatenate(queries), np.concatenate(earlier)


def score_patterns(pattern: torch.Tensor, tokens: np.ndarray) -> torch.Tensor:
    """One layer's scores on the probe: weights `(S, H, T, T)`, ids `[S, T]` -> `(3, H)`, the
    `PROBE_SCORES` of each head, each the mean over the S sequences of that sequence's score.

    The same formulas as `llmcli.inspection.metrics` (`prev_token_score`, and
    `induction_score` / `duplicate_token_score` with `unique=True`), computed where the weights
    are and reading only the weights they score: a layer's weights never leave the device.
    """
    S, H = pattern.shape[:2]
    s, q, k = (torch.as_tensor(a, device=pattern.device) for a in unambiguous_pairs(tokens))
    counts = torch.bincount(s, minlength=S).to(pattern.dtype)[:, None]  # (S, 1)

    def per_sequence_mean(keys: torch.Tensor) -> torch.Tensor:
        weights = pattern[s, :, q, keys]  # (pairs, H)
        sums = torch.zeros(S, H, dtype=pattern.dtype, device=pattern.device)
        return (sums.index_add_(0, s, weights) / counts).mean(0)  # (S, H) -> (H,)

    prev = pattern.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1).mean(0)  # (S, H, T-1) -> (H,)
    return torch.stack([prev, per_sequence_mean(k + 1), per_sequence_mean(k)])  # (3, H)


@torch.no_grad()
def probe_scores(model: torch.nn.Module, probe: Probe) -> ProbeScores:
    """Run `model` on the probe (eval mode, dropout off; the mode is restored) and score every
    head at its layer's `attn.pattern` hook point.

    Touches no random number generator, so evaluating during training leaves its stream as it
    was.
    """
    tokens = probe.tokens.numpy()
    layers: list[torch.Tensor] = []

    def score(pattern: torch.Tensor) -> None:  # (S, H, T, T)
        layers.append(score_patterns(pattern.float(), tokens))

    hooks = {f"blocks.{i}.attn.pattern": score for i in range(model.n_layer)}
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with model.hooks(hooks):
            model(probe.tokens.to(device))
    finally:
        model.train(was_training)
    grid = torch.stack(layers, dim=1).double().cpu().numpy()  # L x (3, H) -> (3, L, H)
    return ProbeScores(*grid)
