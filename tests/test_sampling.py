"""The sampling maths (llmcli/generation/sampling.py): temperature, top-k and top-p on hand-made
logits against a numpy reference, draw frequencies, inverse-CDF edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from llmcli.generation.sampling import _filtered, _inverse_cdf, sample_next

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- controls


def numpy_filter(logits, temperature, top_k=None, top_p=1.0):
    """Reference: softmax(logits / T), keep the k best (lowest id on ties), then the smallest
    set of most likely tokens whose mass reaches top_p; renormalise."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = order[: top_k if top_k is not None else len(x)]
    p = np.exp(x[keep] - x[keep].max())
    p /= p.sum()
    if top_p < 1.0:
        n = int(np.searchsorted(np.cumsum(p), top_p - 1e-12)) + 1  # smallest n with cum >= p
        keep, p = keep[:n], p[:n] / p[:n].sum()
    out = np.zeros(len(x))
    out[keep] = p
    return out


def filter_probs(logits, temperature=1.0, top_k=None, top_p=1.0):
    """The distribution `sample_next` draws from, `(B, V)` probabilities in id order."""
    probs, ids = _filtered(logits, temperature, top_k, top_p)  # (B, V') each
    probs = probs / probs.sum(dim=-1, keepdim=True)
    if ids is None:
        return probs
    return torch.zeros(logits.shape, dtype=probs.dtype).scatter_(-1, ids, probs)  # (B, V)


@pytest.mark.parametrize(
    ("logits", "temperature", "top_k", "top_p"),
    [
        ([1.0, 3.0, 3.0, 3.0, 0.0, 2.0], 1.0, 2, 1.0),  # ties at the top: exactly 2 kept
        ([1.0, 3.0, 3.0, 3.0, 0.0, 2.0], 0.7, 4, 1.0),  # the 4th is the single 2.0
        ([2.0, 2.0, 2.0, 2.0], 1.0, 3, 1.0),  # all tied: the 3 lowest ids
        ([0.5, -1.0, 2.0, 0.1], 2.5, None, 1.0),  # temperature alone
        ([0.5, -1.0, 2.0, 0.1], 1.0, 10, 1.0),  # k >= V keeps all
        (np.log([0.5, 0.3, 0.15, 0.05]).tolist(), 1.0, None, 0.75),  # 0.5 + 0.3 reaches 0.75
        (np.log([0.5, 0.3, 0.15, 0.05]).tolist(), 1.0, None, 0.85),  # needs three
        (np.log([0.5, 0.3, 0.15, 0.05]).tolist(), 1.0, None, 0.4),  # the top one alone
        (np.log([0.05, 0.3, 0.15, 0.5]).tolist(), 1.0, None, 0.9),  # order of ids irrelevant
        (np.log([0.4, 0.3, 0.2, 0.1]).tolist(), 1.0, 3, 0.7),  # top-k, then top-p of the rest
        ([1.0, 1.0, 1.0, 1.0], 1.0, None, 0.6),  # ties under top-p: lowest ids first
    ],
)
def test_filter_probs_match_numpy(logits, temperature, top_k, top_p) -> None:
    got = filter_probs(torch.tensor([logits]), temperature, top_k, top_p)[0]
    np.testing.assert_allclose(
        got.numpy(), numpy_filter(logits, temperature, top_k, top_p), atol=1e-6
    )


# Derandomized, as test_fuzz_readers.py's: every run, CI's included, tries the same examples.
@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    logits=st.lists(st.integers(-4, 4).map(float), min_size=1, max_size=12),
    top_k=st.none() | st.integers(1, 14),
    top_p=st.floats(0.05, 1.0),
)
def test_filter_keeps_exactly_k_and_the_smallest_nucleus(logits, top_k, top_p) -> None:
    """Integer logits make ties common: top-k keeps min(k, V) tokens; top-p keeps the most
    likely tokens until their mass reaches top_p, and not one more."""
    top_k_probs = numpy_filter(logits, 1.0, top_k)
    cum = np.cumsum(np.sort(top_k_probs)[::-1])
    assume(np.abs(cum - top_p).min() > 1e-5)  # float32 vs float64 may round a tie either way
    probs = filter_probs(torch.tensor([logits]), 1.0, top_k, top_p)[0].double()
    kept = probs > 0
    if top_p == 1.0 and top_k is not None:
        assert int(kept.sum()) == min(top_k, len(logits))
    np.testing.assert_allclose(probs.numpy(), numpy_filter(logits, 1.0, top_k, top_p), atol=1e-6)
    assert abs(float(probs.sum()) - 1.0) < 1e-6


@pytest.mark.parametrize(
    ("logits", "top_p", "kept"),
    [
        ([0.0, 0.0, 0.0, 0.0], 0.5, [0, 1]),  # 0.25 + 0.25 reaches 0.5 exactly: two tokens
        ([0.0, 0.0, 0.0, 0.0], 0.5000001, [0, 1, 2]),  # a hair more needs a third
        ([0.0, 0.0, 0.0, 0.0], 0.25, [0]),  # the first token alone reaches 0.25
        ([math.log(2.0), 0.0, 0.0], 0.75, [0, 1]),  # 0.5 + 0.25, exact in float32
    ],
)
def test_top_p_stops_at_the_first_token_whose_mass_reaches_it_exactly(logits, top_p, kept) -> None:
    """Probabilities exact in binary, so the cumulative sum meets `top_p` without rounding: the
    token after the mass reaches `top_p` is dropped."""
    probs = filter_probs(torch.tensor([logits]), top_p=top_p)[0]
    assert torch.nonzero(probs).flatten().tolist() == kept


def test_temperature_zero_takes_the_first_best_token_whatever_top_k_top_p_and_generator() -> None:
    logits = torch.tensor([[0.0, 2.0, -1.0, 2.0], [5.0, 1.0, 5.0, 4.0]])  # ties at the top
    for seed in range(3):
        ids = sample_next(logits, torch.Generator().manual_seed(seed), 0.0, top_k=3, top_p=0.1)
        assert ids.tolist() == [1, 0]


def test_top_k_keeps_exactly_k_tokens_on_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 2.0]]).expand(4000, 6)  # (4000, 6)
    ids = sample_next(logits, torch.Generator().manual_seed(0), 1.0, top_k=2)
    assert set(ids.tolist()) == {1, 2}  # nanoGPT's `logits < v[..., -1]` would also keep 3
    ids = sample_next(logits, torch.Generator().manual_seed(0), 1.0, top_k=1)
    assert set(ids.tolist()) == {1}


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, 1.0), (0.5, 4, 1.0), (1.3, None, 0.8), (0.9, 5, 0.9)],
)
def test_sample_frequencies_follow_filtered_distribution(temperature, top_k, top_p) -> None:
    logits = torch.tensor([[0.3, -0.2, 1.5, 0.9, 0.0, 1.1, -1.0, 0.4]])  # (1, 8)
    n = 40_000
    ids = sample_next(
        logits.expand(n, 8), torch.Generator().manual_seed(1), temperature, top_k, top_p
    )
    freq = np.bincount(ids.numpy(), minlength=8) / n
    expected = numpy_filter(logits[0].tolist(), temperature, top_k, top_p)
    np.testing.assert_allclose(freq, expected, atol=0.012)  # ~5 standard deviations
    assert (freq[expected == 0] == 0).all()


def test_inverse_cdf_never_picks_a_zero_probability_token() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 3)  # (3, 5)
    u = torch.tensor([[0.0], [0.5], [1.0 - 2**-53]], dtype=torch.float64)  # (B, 1)
    assert _inverse_cdf(probs, u).tolist() == [1, 3, 3]
