"""Tests for llmcli.inspection.metrics: head metrics on hand-built attention patterns."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from llmcli.inspection.metrics import (
    METRIC_NAMES,
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


def induction_pattern(period: int) -> np.ndarray:
    """Second-copy queries attend to the token after the earlier occurrence; others to self."""
    a = np.eye(2 * period)
    for q in range(period, 2 * period):
        a[q, q] = 0.0
        a[q, q - period + 1] = 1.0
    return a


def test_induction_score_patterns() -> None:
    p = 5
    assert induction_score(induction_pattern(p), p) == pytest.approx(1.0)
    assert induction_score(previous(2 * p), p) == pytest.approx(0.0)
    assert induction_score(uniform(2 * p), p) == pytest.approx(
        np.mean([1 / (q + 1) for q in range(p, 2 * p)])
    )
    # A "duplicate token" head attends to the earlier occurrence itself, not the one after it.
    dup = np.eye(2 * p)
    for q in range(p, 2 * p):
        dup[q, q], dup[q, q - p] = 0.0, 1.0
    assert induction_score(dup, p) == pytest.approx(0.0)
    # Half of the second copy does it: score 1/2.
    half = induction_pattern(4)
    half[4:6] = np.eye(8)[4:6]
    assert induction_score(half, 4) == pytest.approx(0.5)


def test_metrics_import_without_torch() -> None:
    # The scores are plain NumPy: reading a dump's metrics must not need torch installed.
    code = "import sys, llmcli.inspection.metrics; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
