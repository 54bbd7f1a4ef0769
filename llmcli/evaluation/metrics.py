"""Figures of a model's loss: perplexity, and the in-context learning score.

`llmcli eval` reports perplexity beside the loss; the training loop logs both at every
evaluation, and the in-context learning score with `train.head_metrics`.
"""

from __future__ import annotations

import math


def perplexity(loss: float) -> float:
    """`exp(loss)`, infinite where that overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def icl_windows(context_length: int) -> tuple[range, range]:
    """The positions `icl_score` compares: (early, late).

    Olsson et al. (2022) take the loss at token 500 minus the loss at token 50 of a context of
    thousands of tokens; here both are scaled to the model's context: early is the positions
    from 5% to 15% of it (around 10%), late the last 10%, each at least one position.
    """
    T = context_length
    lo = round(0.05 * T)
    early = range(lo, max(lo + 1, round(0.15 * T)))
    late = range(T - max(1, round(0.1 * T)), T)
    return early, late


def icl_score(by_position: list[float]) -> float:
    """The in-context learning score: the mean loss late in the context minus early (see
    `icl_windows`). Negative when later tokens, which see more context, are predicted better;
    it falls when induction heads form (Olsson et al. 2022)."""
    early, late = icl_windows(len(by_position))
    late_loss = sum(by_position[t] for t in late) / len(late)
    early_loss = sum(by_position[t] for t in early) / len(early)
    return late_loss - early_loss
