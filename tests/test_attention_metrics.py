"""Tests for llmcli.inspection.metrics: head metrics on hand-built attention patterns."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from llmcli.inspection.metrics import (
    METRIC_NAMES,
    duplicate_token_score,
    entropy_score,
    head_metrics,
    induction_score,
    mean_distance,
    prev_token_score,
)

T = 8


# ------------------------------------------------------------------ hand-built attention patterns


def uniform(T: int) -> np.ndarray:
    """Each query spreads evenly over keys 0..q."""
    a = np.tril(np.ones((T, T)))
    return a / a.sum(-1, keepdims=True)


def previous(T: int) -> np.ndarray:
    """Each query q >= 1 attends to q - 1 only (query 0 to itself)."""
    a = np.zeros((T, T))
    a[0, 0] = 1.0
    a[np.arange(1, T), np.arange(T - 1)] = 1.0
    return a


def identity(T: int) -> np.ndarray:
    return np.eye(T)


def sink(T: int) -> np.ndarray:
    a = np.zeros((T, T))
    a[:, 0] = 1.0
    return a


def half_prev_half_self(T: int) -> np.ndarray:
    a = np.zeros((T, T))
    a[0, 0] = 1.0
    for q in range(1, T):
        a[q, q - 1] = a[q, q] = 0.5
    return a


def test_uniform_pattern_scores() -> None:
    qs = np.arange(1, T)
    m = head_metrics(uniform(T))
    np.testing.assert_allclose(m[0], 1.0)  # maximal entropy everywhere
    np.testing.assert_allclose(m[1], np.mean(1 / (qs + 1)))
    np.testing.assert_allclose(m[2], np.mean(1 / (qs + 1)))
    np.testing.assert_allclose(m[3], np.mean(qs / 2))  # sum_k (q-k)/(q+1) = q/2


def test_previous_token_pattern_scores() -> None:
    m = head_metrics(previous(T))
    np.testing.assert_allclose(m, [0.0, 1.0, 1 / (T - 1), 1.0], atol=1e-12)


def test_identity_pattern_scores() -> None:
    np.testing.assert_allclose(head_metrics(identity(T)), [0.0, 0.0, 0.0, 0.0], atol=1e-12)


def test_sink_pattern_scores() -> None:
    # Query 0 is excluded, so the sink score is exactly 1 and the distance the mean of 1..T-1.
    m = head_metrics(sink(T))
    np.testing.assert_allclose(m, [0.0, 1 / (T - 1), 1.0, T / 2], atol=1e-12)


def test_mixed_pattern_entropy_against_loop() -> None:
    a = half_prev_half_self(T)
    expected = sum(math.log(2) / math.log(q + 1) for q in range(1, T)) / (T - 1)
    assert entropy_score(a) == pytest.approx(expected)
    assert prev_token_score(a) == pytest.approx(0.5)
    assert mean_distance(a) == pytest.approx(0.5)


def test_random_rows_against_plain_formulas() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, T, T))
    logits[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] = -np.inf
    a = np.exp(logits - logits.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    m = head_metrics(a)
    assert m.shape == (2, 3, len(METRIC_NAMES))
    for i in range(2):
        for j in range(3):
            p = a[i, j]
            ent = np.mean(
                [
                    -sum(p[q, k] * math.log(p[q, k]) for k in range(q + 1)) / math.log(q + 1)
                    for q in range(1, T)
                ]
            )
            prev = np.mean([p[q, q - 1] for q in range(1, T)])
            first = np.mean([p[q, 0] for q in range(1, T)])
            dist = np.mean([sum(p[q, k] * (q - k) for k in range(q + 1)) for q in range(1, T)])
            np.testing.assert_allclose(m[i, j], [ent, prev, first, dist], rtol=1e-10)


def test_single_token_scores_nan() -> None:
    assert np.isnan(head_metrics(np.ones((1, 1)))).all()


def repeated(period: int) -> np.ndarray:
    """Ids 0..period-1, then the same again: every second-copy token occurred once before."""
    return np.tile(np.arange(period), 2)


def induction_pattern(period: int) -> np.ndarray:
    """Second-copy queries attend to the token after the earlier occurrence; others to self."""
    a = np.eye(2 * period)
    for q in range(period, 2 * period):
        a[q, q] = 0.0
        a[q, q - period + 1] = 1.0
    return a


def duplicate_pattern(period: int) -> np.ndarray:
    """Second-copy queries attend to the earlier occurrence of their own token; others to self."""
    a = np.eye(2 * period)
    for q in range(period, 2 * period):
        a[q, q], a[q, q - period] = 0.0, 1.0
    return a


def test_induction_and_duplicate_scores_of_hand_built_patterns() -> None:
    p = 5
    ids = repeated(p)
    for unique in (False, True):
        assert induction_score(induction_pattern(p), ids, unique=unique) == pytest.approx(1.0)
        assert duplicate_token_score(duplicate_pattern(p), ids, unique=unique) == pytest.approx(1)
        assert induction_score(duplicate_pattern(p), ids, unique=unique) == pytest.approx(0.0)
        assert duplicate_token_score(induction_pattern(p), ids, unique=unique) == 0.0
        assert induction_score(previous(2 * p), ids, unique=unique) == pytest.approx(0.0)
        # Uniform attention over q + 1 keys puts 1 / (q + 1) on the one target of each query.
        expected = np.mean([1 / (q + 1) for q in range(p, 2 * p)])
        assert induction_score(uniform(2 * p), ids, unique=unique) == pytest.approx(expected)
        assert duplicate_token_score(uniform(2 * p), ids, unique=unique) == pytest.approx(expected)
    # Half of the second copy does it: score 1/2.
    half = induction_pattern(4)
    half[4:6] = np.eye(8)[4:6]
    assert induction_score(half, repeated(4)) == pytest.approx(0.5)
    # Leading axes (layers, heads) are kept.
    stack = np.stack([induction_pattern(p), uniform(2 * p)])[None]  # (1, 2, T, T)
    assert induction_score(stack, ids).shape == (1, 2)


def test_a_token_seen_several_times_counts_every_earlier_occurrence_unless_unique() -> None:
    ids = np.array([0, 1, 0, 1, 0])  # query 4 saw token 0 at 0 and 2: targets 1 and 3
    a = uniform(5)
    # queries 2, 3, 4: weight on {1}, {2}, {1, 3}: 1/3, 1/4, 2/5
    assert induction_score(a, ids) == pytest.approx(np.mean([1 / 3, 1 / 4, 2 / 5]))
    assert induction_score(a, ids, unique=True) == pytest.approx(np.mean([1 / 3, 1 / 4]))
    # duplicate: weight on {0}, {1}, {0, 2}
    assert duplicate_token_score(a, ids) == pytest.approx(np.mean([1 / 3, 1 / 4, 2 / 5]))
    ideal = np.eye(5)
    ideal[2], ideal[3], ideal[4] = np.eye(5)[1], np.eye(5)[2], [0, 0.5, 0, 0.5, 0]
    assert induction_score(ideal, ids) == pytest.approx(1.0)
    # A vocabulary smaller than the period: the repeats inside a copy make most queries
    # ambiguous; an ideal head that spreads over every target still scores 1.
    ids = np.array([0, 1, 2, 0, 1, 2] * 2)
    before = [[k for k in range(q) if ids[k] == ids[q]] for q in range(len(ids))]
    ideal = np.eye(len(ids))
    for q, ks in enumerate(before):
        if ks:
            ideal[q] = 0.0
            ideal[q, [k + 1 for k in ks]] = 1 / len(ks)
    assert induction_score(ideal, ids) == pytest.approx(1.0)
    assert induction_score(ideal, ids, unique=True) == pytest.approx(1.0)  # queries 3, 4, 5


def test_no_repeated_token_scores_nan() -> None:
    ids = np.arange(6)
    assert np.isnan(induction_score(uniform(6), ids))
    assert np.isnan(duplicate_token_score(uniform(6), ids, unique=True))
    with pytest.raises(ValueError, match="6 tokens|6 ids"):
        induction_score(uniform(5), ids)


def test_metrics_import_without_torch() -> None:
    # The scores are plain NumPy: reading a dump's metrics must not need torch installed.
    code = "import sys, llmcli.inspection.metrics; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
