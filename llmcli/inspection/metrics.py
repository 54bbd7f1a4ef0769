"""Per-head attention metrics: pure NumPy functions of attention maps `[..., T, T]` -> `[...]`.

Attention weights averaged over heads hide what the individual heads do (one head may follow the
previous token while another rests on the first), so every score here is per map, per head:
entropy, previous-token, first-token (attention sink), mean distance, and the induction score on
a sequence that repeats itself.

Shapes: an attention map is `[T, T]`, query x key, each row a probability distribution over the
keys at or before the query (causal); leading axes (batch, layers, heads) are kept.
"""

from __future__ import annotations

import numpy as np

#: The per-head metrics computed on every prompt, in the order of the `metrics` array's last axis.
METRIC_NAMES: tuple[str, ...] = ("entropy", "prev_token", "first_token", "mean_distance")
#: The extra metric `--induction` appends (computed on a repeated random sequence, not the prompt).
INDUCTION = "induction"


# --------------------------------------------------------------------------------------------
# Metrics: pure NumPy functions of attention maps [..., T, T] -> [...].
# Query 0 can only attend to itself, so it carries no information about a head and would pull
# every score towards "attends to position 0 with certainty": all metrics average over the
# queries 1..T-1. A map with T == 1 has no such query and scores NaN.
# --------------------------------------------------------------------------------------------


def _check_maps(attn: np.ndarray) -> np.ndarray:
    attn = np.asarray(attn, dtype=np.float64)
    if attn.ndim < 2 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"attention maps must be [..., T, T], got shape {attn.shape}")
    return attn


def entropy_score(attn: np.ndarray) -> np.ndarray:
    """Normalised entropy: mean over queries q >= 1 of H(row q) / log(q + 1).

    Row q spreads over q + 1 keys, so log(q + 1) is its largest possible entropy: the score is 1
    for uniform attention over the past and 0 for a head that always attends to one key.

    Args:
        attn: attention maps `[..., T, T]` (query x key, rows sum to 1).

    Returns:
        `[...]` scores in [0, 1] (NaN when T == 1).
    """
    attn = _check_maps(attn)
    T = attn.shape[-1]
    if T < 2:
        return np.full(attn.shape[:-2], np.nan)
    p = attn[..., 1:, :]  # (..., T-1, T)
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    ent = -plogp.sum(-1)  # (..., T-1)
    return (ent / np.log(np.arange(2, T + 1))).mean(-1)


def prev_token_score(attn: np.ndarray) -> np.ndarray:
    """Previous-token score: mean over queries q >= 1 of attn[q, q - 1].

    Args:
        attn: attention maps `[..., T, T]`.

    Returns:
        `[...]` scores in [0, 1] (NaN when T == 1).
    """
    attn = _check_maps(attn)
    if attn.shape[-1] < 2:
        return np.full(attn.shape[:-2], np.nan)
    return np.diagonal(attn, offset=-1, axis1=-2, axis2=-1).mean(-1)  # (..., T-1) -> (...)


def first_token_score(attn: np.ndarray) -> np.ndarray:
    """First-token (attention sink) score: mean over queries q >= 1 of attn[q, 0].

    Args:
        attn: attention maps `[..., T, T]`.

    Returns:
        `[...]` scores in [0, 1] (NaN when T == 1).
    """
    attn = _check_maps(attn)
    if attn.shape[-1] < 2:
        return np.full(attn.shape[:-2], np.nan)
    return attn[..., 1:, 0].mean(-1)


def mean_distance(attn: np.ndarray) -> np.ndarray:
    """Mean attention distance: mean over queries q >= 1 of sum_k attn[q, k] * |q - k|, in tokens.

    0 for a head that attends to itself, 1 for a previous-token head, q / 2 on average for uniform
    attention over the past.

    Args:
        attn: attention maps `[..., T, T]`.

    Returns:
        `[...]` distances in tokens (NaN when T == 1).
    """
    attn = _check_maps(attn)
    T = attn.shape[-1]
    if T < 2:
        return np.full(attn.shape[:-2], np.nan)
    pos = np.arange(T)
    dist = np.abs(pos[:, None] - pos[None, :])  # (T, T)
    return (attn[..., 1:, :] * dist[1:]).sum(-1).mean(-1)  # (..., T-1) -> (...)


def induction_score(attn: np.ndarray, period: int) -> np.ndarray:
    """Induction score on a sequence that repeats itself after `period` tokens (Olsson et al. 2022).

    For every query q in the second copy (period <= q < 2 * period), the same token occurred
    earlier at q - period; an induction head attends to the token after that occurrence,
    q - period + 1. The score is the mean of attn[q, q - period + 1] over those queries.

    Args:
        attn: attention maps `[..., T, T]` over the repeated sequence, T >= 2 * period.
        period: the length of one copy.

    Returns:
        `[...]` scores in [0, 1].
    """
    attn = _check_maps(attn)
    if period < 1 or attn.shape[-1] < 2 * period:
        raise ValueError(f"need T >= 2 * period, got T={attn.shape[-1]}, period={period}")
    q = np.arange(period, 2 * period)
    return attn[..., q, q - period + 1].mean(-1)  # (..., period) -> (...)


def head_metrics(attn: np.ndarray) -> np.ndarray:
    """All of `METRIC_NAMES` for attention maps `[..., T, T]` -> `[..., len(METRIC_NAMES)]`."""
    attn = _check_maps(attn)
    scores = [
        entropy_score(attn),
        prev_token_score(attn),
        first_token_score(attn),
        mean_distance(attn),
    ]
    return np.stack(scores, axis=-1)
