"""Preference pairs read from JSONL, fitted to the context and drawn as padded DPO batches."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_helpers import chat_tokenizer

from llmcli.config import DataConfig
from llmcli.data.chat_template import default_template
from llmcli.data.preference_data import (
    PreferenceSampler,
    fit_pair,
    pair_batch,
    prepare_preference_data,
)
from llmcli.data.preferences import EncodedPair
from llmcli.errors import InputError


def ids(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


@pytest.mark.parametrize(
    ("pair", "limit", "expected", "outcome"),
    [
        ((ids(1, 2), ids(3, 4), ids(5)), 4, (ids(1, 2), ids(3, 4), ids(5)), "kept"),
        ((ids(1, 2), ids(3, 4, 6), ids(5)), 4, (ids(1, 2), ids(3, 4), ids(5)), "truncated"),
        ((ids(1, 2, 3, 4), ids(5), ids(6)), 4, None, "skipped"),  # no room for a completion
        ((ids(1, 2), ids(3, 4, 6), ids(3, 4, 7)), 4, None, "skipped"),  # the same once cut
    ],
)
def test_a_pair_too_long_has_its_completions_cut_or_is_skipped(pair, limit, expected, outcome):
    fitted, done = fit_pair(EncodedPair(*pair), limit)
    assert done == outcome
    if expected is None:
        assert fitted is None
    else:
        assert fitted is not None
        got = (fitted.prompt, fitted.chosen, fitted.rejected)
        assert [a.tolist() for a in got] == [a.tolist() for a in expected]


def write_pairs(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def conversational(i: int, reply: str = "yes") -> dict:
    return {
        "prompt": [{"role": "user", "content": f"question {'x' * i}?"}],
        "chosen": [{"role": "assistant", "content": reply}],
        "rejected": [{"role": "assistant", "content": "no"}],
    }


def prepare(tmp_path: Path, rows: list[dict], context_length: int = 64, **data):
    cfg = DataConfig(path=str(write_pairs(tmp_path / "p.jsonl", rows)), format="preference", **data)
    return prepare_preference_data(cfg, context_length, chat_tokenizer(), default_template())


def test_pairs_are_split_counted_and_drawn_as_chosen_then_rejected_rows(tmp_path: Path):
    rows = [conversational(i) for i in range(9)] + [conversational(60), conversational(1, "y" * 60)]
    data = prepare(tmp_path, rows, val_fraction=0.2)
    # 8 train pairs; 3 held out: one kept, one whose long reply is cut, one whose prompt fills
    # the window.
    assert data.train.counts == {"pairs": 8, "kept": 8, "truncated": 0, "skipped": 0}
    assert data.val.counts == {"pairs": 3, "kept": 1, "truncated": 1, "skipped": 1}
    source = tmp_path / "p.jsonl"
    assert data.val.where == [f"{source} line 9", f"{source} line 11"]
    assert data.val.truncated.tolist() == [False, True]
    assert data.val.skipped_at == [f"{source} line 10"]
    assert data.train.where[0] == f"{source} line 1" and not data.train.truncated.any()

    T = 64
    sampler = PreferenceSampler(data.train, data.pad_id, batch_size=3, context_length=T, seed=0)
    x, mask = sampler.next()
    # Rows as long as the batch's longest sequence, which one row fills: no padding to T + 1.
    longest = max(int(mask[i].nonzero()[-1]) + 1 for i in range(6))
    assert x.shape == mask.shape == (6, longest) and longest < T + 1
    assert (x.dtype, mask.dtype) == (torch.int64, torch.bool)
    for i in range(3):
        chosen, rejected = x[i], x[3 + i]
        start = int(mask[i].nonzero()[0])
        # The same prompt before both completions, which start where the mask does.
        assert torch.equal(chosen[:start], rejected[:start])
        assert start == int(mask[3 + i].nonzero()[0])
        assert chosen[mask[i]].tolist() != rejected[mask[3 + i]].tolist()
        # Nothing after a sequence's end is in the mask: it is padding.
        last = int(mask[i].nonzero()[-1])
        assert (x[i, last + 1 :] == data.pad_id).all() and not mask[i, last + 1 :].any()

    val = PreferenceSampler(data.val, data.pad_id, batch_size=4, context_length=T, seed=0)
    x, mask = val.next()
    assert int(mask.sum(dim=1).max()) <= T + 1


def test_a_batch_in_order_is_padded_to_its_longest_sequence(tmp_path: Path):
    data = prepare(tmp_path, [conversational(i, "y" * (3 * i + 1)) for i in range(6)])
    ids, mask = pair_batch(data.train, [3, 0], data.pad_id)
    split = data.train
    lengths = [
        np.diff(offsets)[[3, 0]] for offsets in (split.chosen_offsets, split.rejected_offsets)
    ]
    assert ids.shape == mask.shape == (4, max(int(n.max()) for n in lengths))
    # Row 0 is pair 3's chosen sequence whole, row 3 pair 0's rejected one, then padding.
    chosen = split.chosen[split.chosen_offsets[3] : split.chosen_offsets[4]]
    assert ids[0, : len(chosen)].tolist() == chosen.tolist()
    rejected = split.rejected[split.rejected_offsets[0] : split.rejected_offsets[1]]
    assert ids[3, : len(rejected)].tolist() == rejected.tolist()
    assert (ids[3, len(rejected) :] == data.pad_id).all()
    assert mask[3].nonzero()[0].item() == split.prompt_lengths[0]
    assert not mask[3, len(rejected) :].any()


def test_the_sampler_is_seeded_and_resumes_its_stream(tmp_path: Path):
    data = prepare(tmp_path, [conversational(i) for i in range(20)])
    make = lambda seed: PreferenceSampler(data.train, data.pad_id, 2, 64, seed=seed)  # noqa: E731
    a, b = make(1), make(1)
    for _ in range(3):
        (xa, ma), (xb, mb) = a.next(), b.next()
        assert torch.equal(xa, xb) and torch.equal(ma, mb)
    assert not torch.equal(make(2).next()[0], make(1).next()[0])
    state = a.state_dict()
    expected = a.next()
    resumed = make(99)
    resumed.load_state_dict(state)
    got = resumed.next()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert resumed.batches == a.batches == 4


def test_sources_that_cannot_train_are_refused_with_the_fix(tmp_path: Path):
    with pytest.raises(InputError, match=r"holds 1 preference pair: too few.*data.val_path"):
        prepare(tmp_path, [conversational(1)])
    with pytest.raises(
        InputError, match=r"nothing left to learn from: 3 pairs of .*raise model.context"
    ):
        prepare(tmp_path, [conversational(50)] * 4, context_length=16)
    with pytest.raises(
        InputError, match=r"p.jsonl line 2: a row must be .* no .chosen., .rejected."
    ):
        prepare(tmp_path, [conversational(1), {"prompt": "x"}])


def implicit(row: dict) -> dict:
    """TRL's implicit-prompt form of an explicit conversational row."""
    return {key: row["prompt"] + row[key] for key in ("chosen", "rejected")}


def test_a_datasets_source_and_implicit_prompts_read_as_the_same_pairs(tmp_path: Path):
    rows = [conversational(i, reply="yes" * (i % 3 + 1)) for i in range(10)]
    expected = prepare(tmp_path, rows, val_fraction=0.2)
    # The same rows through `datasets` (a local JSONL file as data.dataset), half of them
    # without their prompt, which the shared first messages give.
    mixed = [implicit(r) if i % 2 else r for i, r in enumerate(rows)]
    short = write_pairs(tmp_path / "short.jsonl", mixed[:1])
    cfg = DataConfig(
        path=None,
        dataset=str(short),
        format="preference",
        val_fraction=0.2,
        cache_dir=str(tmp_path),
    )
    with pytest.raises(InputError, match=r"holds 1 preference pair: too few"):
        prepare_preference_data(cfg, 64, chat_tokenizer(), default_template())
    cfg = dataclasses.replace(cfg, dataset=str(write_pairs(tmp_path / "d.jsonl", mixed)))
    got = prepare_preference_data(cfg, 64, chat_tokenizer(), default_template())
    for split in ("train", "val"):
        a, b = getattr(expected, split), getattr(got, split)
        assert a.counts == b.counts
        for name in ("chosen", "chosen_offsets", "rejected", "rejected_offsets", "prompt_lengths"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))

    bad = write_pairs(tmp_path / "bad.jsonl", [{"prompt": "a", "answer": "b"}])
    cfg = dataclasses.replace(cfg, dataset=str(bad))
    with pytest.raises(
        InputError, match=r"has no 'chosen' and 'rejected' columns .*prompt, answer"
    ):
        prepare_preference_data(cfg, 64, chat_tokenizer(), default_template())
