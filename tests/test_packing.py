"""Rows packed whole into rows of the context (llmcli/objectives/packing.py), and DPO's scores
on packed rows against the same rows scored one a row (llmcli/objectives/preference_scores.py)."""

from __future__ import annotations

import pytest
import torch

from llmcli.config import config_from_dict
from llmcli.model.gpt import Transformer
from llmcli.objectives import dpo
from llmcli.objectives.dpo import dpo_step
from llmcli.objectives.dpo_losses import DPOLoss
from llmcli.objectives.grpo_loss import token_logps
from llmcli.objectives.packing import MIN_SAVING, Packing, packing_for
from llmcli.objectives.preference_scores import (
    completion_logps,
    completion_scores,
    target_logps,
    target_scores,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT, VOCAB = 48, 40


def model(seed: int) -> Transformer:
    raw = {"model": {"n_layer": 2, "n_head": 2, "n_embed": 16, "context_length": CONTEXT}}
    net = Transformer(
        config_from_dict(raw).model, VOCAB, generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():  # sharper than the initialisation: scores that differ visibly
        for p in net.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
    return net.eval()


def pair_rows(lengths: list[int], prompt: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `lengths` tokens, cut to the longest and padded with 0 after their ends; each
    row's completion is everything after its first `prompt` tokens."""
    g = torch.Generator().manual_seed(sum(lengths))
    L = max(lengths)
    ids = torch.zeros((len(lengths), L), dtype=torch.long)
    mask = torch.zeros((len(lengths), L), dtype=torch.bool)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[r, prompt:n] = True
    return ids, mask


# 8 pairs, chosen then rejected rows, of 6-25 tokens: packed into rows of 48, a third of the
# positions the 16 rows cut to 25 hold.
LENGTHS = [9, 25, 6, 14, 21, 11, 7, 18, 12, 10, 24, 8, 16, 13, 6, 20]


def test_pack_puts_each_real_position_in_its_sequence_and_unpack_brings_it_back() -> None:
    lengths, width = [3, 5, 2, 4], 5
    packing = Packing.plan(lengths, width, context=8, device=torch.device("cpu"))
    assert packing is not None and packing.real.shape == (2, 8)  # 4 x 5 positions in 2 x 8
    rows = torch.arange(4 * width).view(4, width) + 1
    packed = packing.pack(rows)
    assert int(packing.real.sum()) == sum(lengths)
    for segs, real, row in zip(packing.segments, packing.real, packed, strict=True):
        for s in segs[real].unique().tolist():  # each sequence whole and in order
            got = row[segs == s].tolist()
            r = (got[0] - 1) // width
            assert got == rows[r, : lengths[r]].tolist()
    back = packing.unpack(packed.float(), fill=-1.0)
    for r, n in enumerate(lengths):
        assert back[r, :n].tolist() == rows[r, :n].float().tolist()
        assert (back[r, n:] == -1).all()


def test_packing_is_refused_where_it_saves_too_little() -> None:
    cpu = torch.device("cpu")
    assert Packing.plan([20, 20, 19, 20], 20, context=40, device=cpu) is None  # 2 x 40 = 80
    packed = Packing.plan([20, 20, 10, 10], 20, context=40, device=cpu)  # 2 x 40 of 4 x 20...
    assert packed is None  # ... saves nothing
    assert 1 - 40 / (4 * 12) >= MIN_SAVING  # 4 rows of 12 into one of 40: 17% fewer positions
    assert Packing.plan([10, 9, 12, 8], 12, context=40, device=cpu) is not None


def test_packed_scores_and_their_gradients_are_the_rows_scored_alone() -> None:
    policy = model(0)
    ids, mask = pair_rows(LENGTHS)
    packing = packing_for(policy, mask)
    assert packing is not None  # these rows do pack
    packed = completion_scores(policy, ids, mask, packing)
    packed.logps.sum().backward()
    packed_grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    # One a row, as before packing: the same logits for the same tokens.
    alone = target_scores(policy(ids[:, :-1])[0], ids[:, 1:], mask[:, 1:])
    alone.logps.sum().backward()
    torch.testing.assert_close(packed.logps, alone.logps, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed.logits, alone.logits, rtol=0, atol=1e-5)
    assert torch.equal(packed.tokens, alone.tokens)
    for got, want in zip(packed_grads, (p.grad for p in policy.parameters()), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        want = target_logps(policy(ids[:, :-1])[0], ids[:, 1:], mask[:, 1:])
        got = completion_logps(policy, ids, mask, packing)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_dpo_losses_on_packed_rows_equal_the_rows_one_a_row(monkeypatch) -> None:
    policy, reference = model(1), model(2)
    ids, mask = pair_rows(LENGTHS)
    loss = DPOLoss.from_config(config_from_dict({}).train)
    assert packing_for(policy, mask) is not None  # dpo_step packs these rows
    packed_loss, packed_metrics = dpo_step(policy, reference, ids, mask, loss)
    monkeypatch.setattr(dpo, "packing_for", lambda model, mask: None)
    alone_loss, alone_metrics = dpo_step(policy, reference, ids, mask, loss)
    assert abs(packed_loss.item() - alone_loss.item()) < 1e-6
    assert alone_loss.item() > 0.1  # the two models disagree: a loss that could differ
    for name, value in alone_metrics.items():
        assert packed_metrics[name].item() == pytest.approx(value.item(), abs=1e-5), name


def test_grpo_token_logps_on_packed_rows_are_each_rows_own() -> None:
    policy = model(3)
    ids, mask = pair_rows(LENGTHS, prompt=5)
    packing = packing_for(policy, mask)
    assert packing is not None
    packed = token_logps(policy, ids, 0.7, packing)  # (R, L - 1)
    alone = token_logps(policy, ids, 0.7)
    scored = mask[:, 1:]
    torch.testing.assert_close(packed[scored], alone[scored], rtol=0, atol=1e-5)
    for row, marks in zip(packed, scored, strict=True):  # past a row's end: 0, not padding's
        assert (row[int(marks.nonzero().max()) + 1 :] == 0).all()
