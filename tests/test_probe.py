"""The repeated-random-token probe (llmcli/evaluation/probe.py): what it is made of, and every
head's previous-token, induction and duplicate-token scores on it, against hand-built patterns
and against the NumPy formulas of llmcli/inspection/metrics.py on captured weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_helpers import CORPUS, CTX, build_model

from llmcli.data.tokenizer import BPETokenizer, CharTokenizer
from llmcli.evaluation.probe import (
    PROBE_MAX_PERIOD,
    PROBE_SEQUENCES,
    make_probe,
    probe_scores,
    probe_token_ids,
    repeated_random_tokens,
    score_patterns,
)
from llmcli.inspection.capture import capture_attention
from llmcli.inspection.metrics import (
    duplicate_token_score,
    induction_score,
    prev_token_score,
)

# --- what the probe is made of ----------------------------------------------------------------


def test_the_probe_leaves_out_whitespace_and_the_end_of_text_token() -> None:
    tok = CharTokenizer.train([CORPUS + "\t\r"])
    pool = probe_token_ids(tok)
    texts = [tok.decode([i]) for i in pool]
    assert tok.eot_id not in pool
    assert not {" ", "\n", "\t", "\r"} & set(texts)
    assert sorted(texts) == sorted(c for c in set(CORPUS) if not c.isspace())
    probe = make_probe(tok, context_length=16)
    assert not set(probe.tokens.flatten().tolist()) - set(pool)


def test_a_bpe_probe_leaves_out_special_and_whitespace_tokens() -> None:
    tok = BPETokenizer.train([CORPUS * 4], vocab_size=300)
    pool = probe_token_ids(tok)
    assert tok.eot_id is not None and tok.eot_id not in pool
    for i in range(tok.vocab_size):
        text = tok.decode([i])
        assert (i in pool) == (i != tok.eot_id and text.strip() != ""), (i, text)


def test_no_token_repeats_within_a_copy_and_the_probe_is_fixed() -> None:
    tok = CharTokenizer.train([CORPUS])
    pool = probe_token_ids(tok)
    for context, period in (
        (16, 8),
        (200, len(pool)),
    ):  # the period: context // 2, at most the pool
        probe = make_probe(tok, context_length=context)
        assert probe.period == period and probe.tokens.shape == (PROBE_SEQUENCES, 2 * period)
        for row in probe.tokens.tolist():
            assert row[:period] == row[period:]
            assert len(set(row[:period])) == period  # drawn without replacement
        again = make_probe(tok, context_length=context)
        assert torch.equal(probe.tokens, again.tokens)
    rows = {tuple(r) for r in make_probe(tok, 16).tokens.tolist()}
    assert len(rows) == PROBE_SEQUENCES  # different sequences
    assert make_probe(tok, 4096).period <= PROBE_MAX_PERIOD


def test_a_pool_smaller_than_the_period_repeats_each_token_as_little_as_it_can() -> None:
    x = repeated_random_tokens([3, 5, 7], period=7, batch=4, generator=torch.Generator())
    assert x.shape == (4, 14) and torch.equal(x[:, :7], x[:, 7:])
    for row in x[:, :7].tolist():
        assert sorted(row.count(t) for t in (3, 5, 7)) == [2, 2, 3]


# --- scores on hand-built patterns ------------------------------------------------------------


def ideal(tokens: np.ndarray, kind: str) -> torch.Tensor:
    """Attention `(S, 1, T, T)` of an ideal head: previous-token (each query q >= 1 on q - 1),
    induction (on the token after the one earlier occurrence of its token) or duplicate-token
    (on that occurrence itself); a query with no such target attends to itself."""
    S, T = tokens.shape
    a = torch.zeros(S, 1, T, T, dtype=torch.float64)
    for s in range(S):
        for q in range(T):
            earlier = [k for k in range(q) if tokens[s, k] == tokens[s, q]]
            if kind == "prev_token":
                key = max(q - 1, 0)
            elif len(earlier) == 1:
                key = earlier[0] + (kind == "induction")
            else:
                key = q
            a[s, 0, q, key] = 1.0
    return a


@pytest.mark.parametrize("kind", ["prev_token", "induction", "duplicate_token"])
def test_an_ideal_head_scores_1_on_its_own_score(kind: str) -> None:
    tok = CharTokenizer.train([CORPUS])
    tokens = make_probe(tok, context_length=CTX).tokens.numpy()
    scores = dict(
        zip(
            ("prev_token", "induction", "duplicate_token"),
            score_patterns(ideal(tokens, kind), tokens),
            strict=True,
        )
    )
    assert scores[kind].item() == pytest.approx(1.0)
    for other, value in scores.items():
        if other != kind:
            assert value.item() < 0.2, (kind, other)


def test_uniform_attention_scores_what_the_formula_says() -> None:
    tokens = repeated_random_tokens(range(20), period=6, batch=3, generator=torch.Generator())
    T, p = 12, 6
    a = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]  # row q: 1 / (q + 1)
    prev, ind, dup = score_patterns(a.expand(3, 2, T, T), tokens.numpy())  # (H,) each
    torch.testing.assert_close(prev, torch.full((2,), np.mean([1 / (q + 1) for q in range(1, T)])))
    expected = np.mean([1 / (q + 1) for q in range(p, 2 * p)])  # one target per second-copy query
    torch.testing.assert_close(ind, torch.full((2,), expected, dtype=torch.float32))
    torch.testing.assert_close(dup, torch.full((2,), expected, dtype=torch.float32))


def test_only_unambiguous_queries_count_where_tokens_repeat_inside_a_copy() -> None:
    # A pool of 3 tokens and a period of 7: each token occurs 2-3 times in a copy. The old score
    # (weight on q - period + 1 over the whole second copy) gave an ideal head about 0.6.
    tokens = repeated_random_tokens([0, 1, 2], period=7, batch=4, generator=torch.Generator())
    tokens = tokens.numpy()
    _, ind, dup = score_patterns(ideal(tokens, "induction"), tokens)
    assert ind.item() == pytest.approx(1.0) and dup.item() < 0.5
    _, ind, dup = score_patterns(ideal(tokens, "duplicate_token"), tokens)
    assert dup.item() == pytest.approx(1.0)


# --- a model's scores -------------------------------------------------------------------------


def test_probe_scores_equal_the_numpy_formulas_on_captured_weights() -> None:
    _, tok, model = build_model()
    probe = make_probe(tok, model.context_length)
    model.train()  # scoring switches dropout off by itself and restores the mode
    rng = torch.get_rng_state()
    scores = probe_scores(model, probe)
    assert model.training and torch.equal(torch.get_rng_state(), rng)  # no RNG touched
    _, attn = capture_attention(model, probe.tokens)  # (S, L, H, T, T)
    attn, ids = attn.double().numpy(), probe.tokens.numpy()
    expected = np.mean(
        [
            [
                prev_token_score(attn[s]),
                induction_score(attn[s], ids[s], unique=True),
                duplicate_token_score(attn[s], ids[s], unique=True),
            ]
            for s in range(len(ids))
        ],
        axis=0,
    )  # (3, L, H)
    got = np.stack([scores.prev_token, scores.induction, scores.duplicate_token])
    assert got.shape == (3, 2, 4)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    assert scores.summary() == {
        "induction_max": pytest.approx(expected[1].max()),
        "prev_token_max": pytest.approx(expected[0].max()),
    }
    assert scores.grids()["induction"] == scores.induction.tolist()
