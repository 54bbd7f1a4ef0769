"""The one-token decode step (llmcli/decode.py): the same logits and cache as
`Transformer.forward`, bit for bit, for every recipe option, with and without padding."""

from __future__ import annotations

import itertools

import pytest
import torch
from model_helpers import gen, randomize_, tiny_model

from llmcli.decode import Decoder, decoder_for

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIONS = [
    dict(pos_emb=pos, norm=norm, qk_norm=qk, mlp=mlp, bias=bias, tie_embeddings=tie)
    for pos, norm, qk, mlp, bias, tie in itertools.product(
        ["learned", "rope"],
        ["layernorm", "rmsnorm"],
        [False, True],
        ["gelu", "relu2"],
        [True, False],
        [True, False],
    )
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
