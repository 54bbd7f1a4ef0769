"""The logit lens (llmcli/inspection/lens.py) against the model's own output and hand-run blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from interpret_helpers import ARCHS, char_model, hand_stream, ids_of
from model_helpers import assert_close

from llmcli.errors import InputError
from llmcli.inspection.lens import format_lens, logit_lens

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "All:\nSpeak, sir."


@pytest.mark.parametrize("arch", ["default", "rope", "all"])
def test_last_row_is_the_models_own_logprobs(arch) -> None:
    tok, model = char_model(1, **ARCHS[arch])
    idx = ids_of(tok, PROMPT)
    lens = logit_lens(model, tok, idx[0].tolist())
    with torch.no_grad():
        logp = torch.log_softmax(model(idx)[0][0], dim=-1)  # (T, V)
    T = idx.shape[1]
    expected = logp[torch.arange(T - 1), idx[0, 1:]]  # (T - 1,)
    assert lens.logprobs.shape == (model.n_layer + 1, T - 1)
    assert lens.layers == ["embed", "0", "1"]
    assert_close(torch.from_numpy(lens.logprobs[-1]).float(), expected, "last row", atol=1e-5)
    assert lens.top_tokens[-1] == [tok.decode([i]) for i in logp.argmax(-1).tolist()]


@pytest.mark.parametrize("arch", ["default", "rmsnorm", "untied"])
def test_every_row_equals_the_first_blocks_run_by_hand(arch) -> None:
    tok, model = char_model(2, **ARCHS[arch])
    idx = ids_of(tok, PROMPT)
    lens = logit_lens(model, tok, idx[0].tolist())
    T = idx.shape[1]
    for k in range(model.n_layer + 1):  # 0: the embedding alone
        with torch.no_grad():
            logp = torch.log_softmax(model.to_logits(hand_stream(model, idx, k))[0], dim=-1)
        expected = logp[torch.arange(T - 1), idx[0, 1:]]
        assert_close(torch.from_numpy(lens.logprobs[k]).float(), expected, f"row {k}")
        assert lens.top_tokens[k] == [tok.decode([i]) for i in logp.argmax(-1).tolist()]
        assert lens.loss[k] == pytest.approx(-expected.double().mean().item(), abs=1e-5)


def test_a_tied_embedding_reads_each_token_back_at_the_embedding() -> None:
    # With the LM head tied to the token embedding, the embedding boundary of a model whose
    # embedding dominates predicts each token itself: a check of the embedding row's meaning.
    tok, model = char_model(3, pos_emb="rope")
    with torch.no_grad():
        model.wte.weight.mul_(20.0)
        model.ln_f.weight.fill_(1.0)
        model.ln_f.bias.zero_()
    idx = ids_of(tok, PROMPT)
    lens = logit_lens(model, tok, idx[0].tolist())
    assert lens.top_tokens[0] == lens.tokens


def test_json_and_text() -> None:
    tok, model = char_model(4)
    lens = logit_lens(model, tok, tok.encode("Speak"))
    d = lens.to_dict()
    assert set(d) >= {"layers", "tokens", "logprobs", "top_tokens"}
    assert np.array(d["logprobs"]).shape == (3, 4)
    assert np.array(d["top_tokens"]).shape == (3, 5)
    assert d["tokens"] == list("Speak") and d["prompt"] == "Speak"
    lines = format_lens(lens).splitlines()
    assert lines[1].split() == ["layer", "loss", *"Speak"]
    assert [line.split()[0] for line in lines[2:]] == ["embed", "0", "1"]
    assert float(lines[2].split()[1]) == pytest.approx(lens.loss[0], abs=1e-3)


def test_one_token_is_refused() -> None:
    tok, model = char_model()
    with pytest.raises(InputError, match="at least 2 tokens"):
        logit_lens(model, tok, tok.encode("S"))
