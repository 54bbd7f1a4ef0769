"""Per-head attention metrics: pure NumPy functions of attention maps `[..., T, T]` -> `[...]`.

Attention weights averaged over heads hide what the individual heads do (one head may follow the
previous token while another rests on the first), so every score here is per map, per head:
entropy, previous-token, first-token (attention sink), mean distance, and the scores that need
the tokens too: induction and duplicate-token, on the repeats of a sequence.

Shapes: an attention map is `[T, T]`, query x key, each row a probability distribution over the
keys at or before the query (causal); leading axes (batch, layers, heads) are kept.
"""

from __future__ import annotations

import numpy as np

from llmcli.evaluation.repeats import earlier_occurrences

#: The per-head metrics computed on every prompt, in the order of the `metrics` array's last axis.
METRIC_NAMES: tuple[str, ...] = ("entropy", "prev_token", "first_token", "mean_distance")
#: The metrics `--induction` appends: the induction score on the prompt's own repeats, and on the
#: fixed probe of repeated random tokens (`llmcli.evaluation.probe`, the same for every prompt).
INDUCTION = "induction"
PROBE_INDUCTION = "probe_induction"


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


def _query_mean(per_query: np.ndarray) -> np.ndarray:
    """`[..., T-1]` scores of the queries 1..T-1 -> their mean `[...]`; NaN where there are
    none (T == 1)."""
    if per_query.shape[-1] == 0:
        return np.full(per_query.shape[:-1], np.nan)
    return per_query.mean(-1)


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
    p = attn[..., 1:, :]  # (..., T-1, T)
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    ent = -plogp.sum(-1)  # (..., T-1)
    return _query_mean(ent / np.log(np.arange(2, T + 1)))


def prev_token_score(attn: np.ndarray) -> np.ndarray:
    """Previous-token score `[...]` of maps `[..., T, T]`: mean over queries q >= 1 of
    attn[q, q - 1], in [0, 1]."""
    attn = _check_maps(attn)
    return _query_mean(np.diagonal(attn, offset=-1, axis1=-2, axis2=-1))  # (..., T-1) -> (...)


def first_token_score(attn: np.ndarray) -> np.ndarray:
    """First-token (attention sink) score `[...]` of maps `[..., T, T]`: mean over queries
    q >= 1 of attn[q, 0], in [0, 1]."""
    attn = _check_maps(attn)
    # The column as a slice (..., T-1, 1) summed, not indexed: maps of no tokens have no key 0.
    return _query_mean(attn[..., 1:, :1].sum(-1))  # (..., T-1) -> (...)


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
    pos = np.arange(attn.shape[-1])
    dist = np.abs(pos[:, None] - pos[None, :])  # (T, T)
    return _query_mean((attn[..., 1:, :] * dist[1:]).sum(-1))  # (..., T-1) -> (...)


def _repeat_score(
    attn: np.ndarray, earlier: np.ndarray, targets: np.ndarray, unique: bool
) -> np.ndarray:
    """Mean, over the queries whose token occurred before (exactly once with `unique`), of the
    weight each puts on its `targets` keys (NaN for no such query).

    Shape:
        attn `[..., T, T]`; earlier, targets `(T, T)` bool: `earlier[q, k]` where token k is an
        earlier occurrence of query q's -> `[...]`.
    """
    count = earlier.sum(-1)  # (T,)
    queries = count == 1 if unique else count >= 1
    attn = _check_maps(attn)
    if attn.shape[-1] != len(queries):
        raise ValueError(f"attention maps of {attn.shape[-1]} tokens for {len(queries)} ids")
    if not queries.any():
        return np.full(attn.shape[:-2], np.nan)
    weight = (attn * targets).sum(-1)  # (..., T): each query's weight on its targets
    return weight[..., queries].mean(-1)


def induction_score(attn: np.ndarray, ids: np.ndarray, *, unique: bool = False) -> np.ndarray:
    """Induction score on a token sequence (Olsson et al. 2022's prefix matching).

    An induction head at query q, whose token occurred earlier at k, attends to the token that
    followed it, k + 1 (and then copies it). The score is the mean, over the queries whose
    token occurred before, of the total weight on the tokens after its earlier occurrences:
    1 for an ideal induction head. With `unique`, only queries whose token occurred exactly
    once before are scored (an unambiguous target, as on the repeated-random-token probe).

    Args:
        attn: attention maps `[..., T, T]` over the sequence.
        ids: the sequence's token ids `[T]`.
        unique: score only queries with exactly one earlier occurrence.

    Returns:
        `[...]` scores in [0, 1] (NaN when no query qualifies).
    """
    earlier = earlier_occurrences(ids)  # (T, T)
    targets = np.zeros_like(earlier)
    targets[:, 1:] = earlier[:, :-1]  # (q, k + 1) for each earlier occurrence k; k + 1 <= q
    return _repeat_score(attn, earlier, targets, unique)


def duplicate_token_score(attn: np.ndarray, ids: np.ndarray, *, unique: bool = False) -> np.ndarray:
    """Duplicate-token score: like `induction_score` (the same arguments and range), the weight
    on the earlier occurrences of the query's own token themselves, not on the tokens after
    them. 1 for an ideal duplicate-token head."""
    earlier = earlier_occurrences(ids)  # (T, T)
    return _repeat_score(attn, earlier, earlier, unique)


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
