"""What the lens, patching and attribution share (llmcli/inspection/answers.py): the answer's
metric against formulas on the model's logits, prompts and answers refused with clear messages."""

from __future__ import annotations

import pytest
import torch
from interpret_helpers import char_model, ids_of

from llmcli.errors import InputError
from llmcli.inspection.answers import AnswerMetric, encode_text, one_token, record

pytestmark = pytest.mark.usefixtures("one_thread")


def test_metric_values() -> None:
    tok, model = char_model()
    logits = torch.randn(3, tok.vocab_size, generator=torch.Generator().manual_seed(0))
    a, w = tok.encode("e")[0], tok.encode("s")[0]
    diff = AnswerMetric.from_texts(tok, "e", "s")
    torch.testing.assert_close(diff(logits), logits[:, a] - logits[:, w])
    assert diff.name == "logit_diff" and diff.describe() == "logit('e') - logit('s')"
    unembed = model.lm_head.weight
    torch.testing.assert_close(diff.direction(unembed), unembed[a] - unembed[w])
    alone = AnswerMetric.from_texts(tok, "e")
    expected = logits[:, a] - torch.logsumexp(logits, dim=-1)
    torch.testing.assert_close(alone(logits), expected)
    torch.testing.assert_close(alone.logit_value(logits), logits[:, a])
    assert alone.name == "logprob" and alone.to_dict() == {
        "answer": "e",
        "wrong": None,
        "metric": "logprob",
    }


def test_record_equals_a_plain_forward() -> None:
    tok, model = char_model(1, pos_emb="rope")
    idx = ids_of(tok, "All:\nSpeak.").expand(3, -1)
    with torch.no_grad():
        logits, _ = model(idx)
    acts, recorded = record(model, idx, ["blocks.1.resid_post"])
    torch.testing.assert_close(recorded, logits)
    torch.testing.assert_close(model.to_logits(acts["blocks.1.resid_post"]), logits)


def test_answers_that_are_not_one_token_are_refused() -> None:
    tok, _ = char_model()
    assert one_token(tok, "e", "--answer") == tok.encode("e")[0]
    with pytest.raises(
        InputError, match=r"--answer must be exactly one token.*2 tokens \('S', 'p'\)"
    ):
        one_token(tok, "Sp", "--answer")
    with pytest.raises(InputError, match=r"--wrong must be exactly one token.*0 tokens \(none\)"):
        AnswerMetric.from_texts(tok, "e", "")
    with pytest.raises(InputError, match="--answer and --wrong are the same token"):
        AnswerMetric.from_texts(tok, "e", "e")


def test_prompts_must_fit_as_given() -> None:
    tok, _ = char_model()
    assert encode_text(tok, "Speak", 16, "--prompt") == tok.encode("Speak")
    with pytest.raises(InputError, match="--prompt is empty"):
        encode_text(tok, "", 16, "--prompt")
    with pytest.raises(InputError, match=r"--clean is 20 tokens long .* context_length is 16"):
        encode_text(tok, "Speak, speak. Speak.", 16, "--clean")
