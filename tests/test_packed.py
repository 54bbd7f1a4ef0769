"""Packed conversation rows' loss (llmcli/objectives/chat.py): the mask and positions by hand,
and a packed conversation's per-token losses and gradients equal to the same conversation's
alone, with learned and with rotary positions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmcli.config import ModelConfig
from llmcli.model.gpt import Transformer
from llmcli.objectives.chat import packed_next_token_loss
from llmcli.objectives.packing import segment_mask, segment_positions

VOCAB = 13


def test_positions_restart_and_each_segment_attends_only_to_itself() -> None:
    segments = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    assert segment_positions(segments).tolist() == [[0, 1, 2, 0, 1, 0, 1], list(range(7))]
    mask = segment_mask(segments)
    assert mask.shape == (2, 1, 7, 7) and mask.dtype == torch.bool
    row = mask[0, 0].int().tolist()
    assert row == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0],  # the second conversation starts afresh
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 0],  # the padding attends within itself
        [0, 0, 0, 0, 0, 1, 1],
    ]
    assert torch.equal(mask[1, 0], torch.ones(7, 7, dtype=torch.bool).tril())  # one: causal


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_a_packed_conversation_has_the_loss_and_gradients_of_it_alone(pos_emb: str) -> None:
    config = ModelConfig(
        n_layer=2, n_head=2, n_embed=16, context_length=16, dropout=0.0, pos_emb=pos_emb
    )
    model = Transformer(config, VOCAB, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    conversations = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 7, 4)]  # L tokens
    targets = [ids[1:].clone() for ids in conversations]
    targets[1][:2] = -1  # not the assistant's: left out of the loss, as the sampler marks them
    # One row of 16: the three take 4 + 6 + 3 positions, then 3 of padding (id 0, target -1).
    x = torch.cat([ids[:-1] for ids in conversations] + [torch.zeros(3, dtype=torch.long)])
    y = torch.cat([*targets, torch.full((3,), -1)])
    segments = torch.tensor([1] * 4 + [2] * 6 + [3] * 3 + [0] * 3)
    batch = (x[None], y[None], segments[None])  # (1, 16) each

    loss, _ = packed_next_token_loss(model, batch)
    alone = [
        model(ids[None, :-1], t[None])[1] for ids, t in zip(conversations, targets, strict=True)
    ]
    counts = [int((t != -1).sum()) for t in targets]
    expected = sum(a * n for a, n in zip(alone, counts, strict=True)) / sum(counts)
    torch.testing.assert_close(loss, expected)

    mask, pos = segment_mask(batch[2]), segment_positions(batch[2])
    logits = model(batch[0], mask=mask, input_pos=pos)[0][0]  # (16, V)
    per_token = F.cross_entropy(logits, y, ignore_index=-1, reduction="none")  # (16,)
    start = 0
    for ids, t in zip(conversations, targets, strict=True):
        n = len(ids) - 1
        own = F.cross_entropy(model(ids[None, :-1])[0][0], t, ignore_index=-1, reduction="none")
        torch.testing.assert_close(per_token[start : start + n], own)
        start += n

    # The middle conversation's gradients, packed and alone (it starts at position 4).
    def gradients(loss: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    packed_logits = model(batch[0], mask=mask, input_pos=pos)[0][0, 4:10]
    packed = gradients(F.cross_entropy(packed_logits, targets[1], ignore_index=-1))
    own = gradients(model(conversations[1][None, :-1], targets[1][None])[1])
    assert any(float(g.abs().max()) > 0 for g in own)
    for a, b in zip(packed, own, strict=True):
        torch.testing.assert_close(a, b)
    # Without the segments (one causal row from 0), the middle one's loss is another.
    plain = F.cross_entropy(model(batch[0])[0][0, 4:10], targets[1], ignore_index=-1)
    assert not torch.allclose(plain, F.cross_entropy(packed_logits, targets[1], ignore_index=-1))
