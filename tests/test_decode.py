"""The one-token decode step (llmcli/decode.py): the same logits and cache as
`Transformer.forward`, bit for bit, for every pair of recipe option values, with and without
padding."""

from __future__ import annotations

import pytest
import torch
from model_helpers import gen, randomize_, tiny_model

from llmcli.decode import Decoder, decoder_for

pytestmark = pytest.mark.usefixtures("one_thread")

# Eight models in which every pair of option values occurs (an orthogonal array: 2 rows each).
L8 = ["000000", "000111", "011001", "011110", "101010", "101101", "110011", "110100"]
CHOICES = [
    ("pos_emb", "learned", "rope"),
    ("norm", "layernorm", "rmsnorm"),
    ("qk_norm", False, True),
    ("mlp", "gelu", "relu2"),
    ("bias", True, False),
    ("tie_embeddings", True, False),
]
OPTIONS = [
    {name: values[int(bit)] for (name, *values), bit in zip(CHOICES, row, strict=True)}
    for row in L8
]


def option_id(opts: dict) -> str:
    return "-".join(str(v) for v in opts.values())


@pytest.mark.parametrize("opts", OPTIONS, ids=[option_id(o) for o in OPTIONS])
def test_decode_step_equals_forward_bit_for_bit(opts) -> None:
    model = randomize_(tiny_model(**opts)).eval()
    g = gen(1)
    B = 3
    for padded in (False, True):
        with torch.inference_mode():
            prompt = torch.randint(37, (B, 5), generator=g)  # (B, 5)
            mask = None
            if padded:  # rows of 3, 5 and 1 real tokens, left-padded
                mask = torch.zeros(B, 5, dtype=torch.bool)
                mask[0, :2], mask[2, :4] = True, True
            ours, theirs = model.new_kv_cache(B), model.new_kv_cache(B)
            model(prompt, key_padding_mask=mask, kv_cache=ours)
            model(prompt, key_padding_mask=mask, kv_cache=theirs)
            decoder = Decoder(model)
            for t in range(8):
                idx = torch.randint(37, (B,), generator=g)  # (B,)
                pos = (torch.tensor([3, 5, 1]) + t)[:, None] if padded else None  # (B, 1)
                expected, _ = model(idx[:, None], position_ids=pos, kv_cache=theirs)
                got = decoder(idx, ours, pos)
                assert torch.equal(got, expected[:, -1]), f"step {t}, padded={padded}"
        assert ours.length == theirs.length == 13
        assert torch.equal(ours.k, theirs.k) and torch.equal(ours.v, theirs.v)
        assert torch.equal(ours.padding, theirs.padding)


def test_decoder_only_for_a_transformer_in_eval_mode() -> None:
    model = tiny_model()
    assert isinstance(decoder_for(model), Decoder)
    assert decoder_for(model.train()) is None  # dropout: forward's business
    assert decoder_for(torch.nn.Linear(2, 2)) is None
