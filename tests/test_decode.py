"""The one-token decode step (llmcli/generation/decode.py): the same logits and cache as
`Transformer.forward` run with the same GELU kernel, bit for bit, for every pair of recipe
option values, with and without padding; and `small_gelu`, which picks ATen's GELU kernel for a
generation with small steps."""

from __future__ import annotations

import contextlib

import pytest
import torch
from model_helpers import gen, randomize_, tiny_model

from llmcli.generation.decode import Decoder, decoder_for, small_gelu

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


@contextlib.contextmanager
def onednn(enabled: bool):
    """oneDNN on or off for the block (on the CPU it runs GELU when on), as it was after."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


@pytest.mark.parametrize("opts", OPTIONS, ids=[option_id(o) for o in OPTIONS])
def test_decode_step_equals_forward_bit_for_bit(opts) -> None:
    model = randomize_(tiny_model(**opts)).eval()
    g = gen(1)
    B = 3
    for padded, kernel in ((False, True), (True, True), (False, False), (True, False)):
        with torch.inference_mode(), onednn(kernel):  # oneDNN's GELU kernel, or ATen's
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


def test_decoder_only_for_a_transformer_in_eval_mode_without_hooks() -> None:
    model = tiny_model()
    assert isinstance(decoder_for(model), Decoder)
    assert decoder_for(model.train()) is None  # dropout: forward's business
    assert decoder_for(torch.nn.Linear(2, 2)) is None
    with model.eval().hooks({"blocks.1.mlp_out": lambda x: None}):  # hooks see every step
        assert decoder_for(model) is None
    assert isinstance(decoder_for(model), Decoder)


@pytest.mark.parametrize("enabled", [True, False])
def test_small_gelu_leaves_onednn_as_it_found_it(enabled) -> None:
    model = randomize_(tiny_model(mlp="gelu")).eval()
    with onednn(enabled):
        with small_gelu(model, 1):
            assert torch.backends.mkldnn.enabled is False
        assert torch.backends.mkldnn.enabled is enabled
        with pytest.raises(IndexError), small_gelu(model, 1):  # a step that fails restores it too
            model(torch.tensor([[10**6]]))
        assert torch.backends.mkldnn.enabled is enabled


def test_decode_step_on_atens_gelu_stays_within_1e_5_of_forward_on_onednn() -> None:
    """oneDNN's GELU (torch's default on the CPU) and ATen's, which `llmcli sample` gives the
    step, agree to a few units in the last place: the logits agree far below any sampling
    threshold, and a greedy run picks the same tokens."""
    model = randomize_(tiny_model(mlp="gelu")).eval()
    g = gen(2)
    with torch.inference_mode():
        prompt = torch.randint(37, (4, 6), generator=g)  # (B, T)
        ours, theirs = model.new_kv_cache(4), model.new_kv_cache(4)
        model(prompt, kv_cache=ours)
        model(prompt, kv_cache=theirs)
        decoder = Decoder(model)
        idx = prompt[:, -1]
        for _ in range(10):
            expected, _ = model(idx[:, None], kv_cache=theirs)  # oneDNN's GELU
            with small_gelu(model, 4):
                got = decoder(idx, ours, None)
            torch.testing.assert_close(got, expected[:, -1], rtol=1e-5, atol=1e-5)
            assert torch.equal(got.argmax(-1), expected[:, -1].argmax(-1))
            idx = got.argmax(-1)


@pytest.mark.parametrize(
    ("mlp", "rows", "limit", "aten"),
    [
        ("gelu", 1, None, True),  # one row: ATen's kernel
        ("gelu", 3, 3 * 128, True),  # 3 rows of 4C = 128 values, at the limit
        ("gelu", 3, 3 * 128 - 1, False),  # past it: oneDNN, faster on large inputs
        ("relu2", 1, None, False),  # no GELU: the flag is left alone
    ],
)
def test_small_gelu_moves_only_small_gelus_off_onednn(mlp, rows, limit, aten, monkeypatch) -> None:
    import llmcli.generation.decode

    if limit is not None:
        monkeypatch.setattr(llmcli.generation.decode, "ATEN_GELU_MAX", limit)
    model = randomize_(tiny_model(mlp=mlp)).eval()
    with onednn(True), small_gelu(model, rows):
        assert torch.backends.mkldnn.enabled is not aten
