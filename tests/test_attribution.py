"""Direct logit attribution (llmcli/inspection/attribution.py): the parts add up to the model's
own logit difference on every architecture option, and a head's part equals the formula
computed in NumPy from the head's output and the final stream of a hand-run forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from interpret_helpers import ARCHS, char_model, hand_stream

from llmcli.inspection.answers import AnswerMetric, record
from llmcli.inspection.attribution import attribute, format_attribution

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "All:\nSpeak, sir."


def total(result) -> float:
    return result.embed + result.heads.sum() + result.mlp.sum() + result.rest


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("wrong", ["s", None])
def test_parts_sum_to_the_logit_difference(arch, wrong) -> None:
    tok, model = char_model(1, **ARCHS[arch])
    metric = AnswerMetric.from_texts(tok, "e", wrong)
    ids = tok.encode(PROMPT)
    result = attribute(model, tok, ids, metric)
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0][0, -1]  # (V,)
    a, w = tok.encode("e")[0], tok.encode("s")[0]
    expected = logits[a] - (logits[w] if wrong else 0.0)
    assert result.logit_diff == pytest.approx(float(expected), abs=1e-5)
    assert total(result) == pytest.approx(result.logit_diff, abs=1e-4)
    assert result.heads.shape == (2, 4) and result.mlp.shape == (2,)
    assert np.abs(result.heads).max() > 1e-3  # the random heads do write the answer


def numpy_norm_parts(model, x: np.ndarray):
    """(centred, scale, gain) of the final norm on the stream `x` `(C,)`, in NumPy."""
    norm = model.ln_f
    gain = norm.weight.detach().double().numpy()
    if model.config.norm == "layernorm":
        return True, np.sqrt(x.var() + norm.eps), gain
    return False, np.sqrt((x**2).mean() + norm.eps), gain


@pytest.mark.parametrize("arch", ["default", "all"])
def test_a_heads_part_is_its_output_through_the_frozen_norm(arch) -> None:
    tok, model = char_model(2, **ARCHS[arch])
    metric = AnswerMetric.from_texts(tok, "e", "s")
    ids = tok.encode(PROMPT)
    result = attribute(model, tok, ids, metric)
    x = hand_stream(model, torch.tensor([ids]), model.n_layer)[0, -1].double().numpy()  # (C,)
    centre, scale, gain = numpy_norm_parts(model, x)
    unembed = model.lm_head.weight.detach().double().numpy()  # (V, C)
    direction = unembed[metric.answer] - unembed[metric.wrong]
    hs = model.n_embed // model.n_head
    layer, head = 1, 3
    acts, _ = record(model, torch.tensor([ids]), [f"blocks.{layer}.attn.z"])
    z = acts[f"blocks.{layer}.attn.z"][0, -1, head].double().numpy()  # (hs,)
    w_o = model.blocks[layer].attn.proj.weight.detach().double().numpy()  # (C, C)
    out = w_o[:, head * hs : (head + 1) * hs] @ z  # (C,): what the head writes
    if centre:
        out = out - out.mean()
    assert result.heads[layer, head] == pytest.approx(
        float(out / scale * gain @ direction), abs=1e-6
    )
    # The MLP's part the same way, its whole output (bias included).
    acts, _ = record(model, torch.tensor([ids]), ["blocks.0.mlp_out"])
    mlp = acts["blocks.0.mlp_out"][0, -1].double().numpy()
    if centre:
        mlp = mlp - mlp.mean()
    assert result.mlp[0] == pytest.approx(float(mlp / scale * gain @ direction), abs=1e-6)


def test_a_head_that_writes_nothing_has_no_part() -> None:
    tok, model = char_model(3)
    hs = model.n_embed // model.n_head
    with torch.no_grad():
        model.blocks[1].attn.proj.weight[:, hs : 2 * hs] = 0.0
    result = attribute(model, tok, tok.encode(PROMPT), AnswerMetric.from_texts(tok, "e", "s"))
    assert result.heads[1, 1] == 0.0
    assert total(result) == pytest.approx(result.logit_diff, abs=1e-4)


def test_json_and_text() -> None:
    tok, model = char_model(4)
    result = attribute(model, tok, tok.encode(PROMPT), AnswerMetric.from_texts(tok, "e", "s"))
    data = result.to_dict()
    assert {"logit_diff", "embed", "heads", "mlp", "rest"} <= set(data)
    assert np.array(data["heads"]).shape == (2, 4) and len(data["mlp"]) == 2
    parts = data["embed"] + np.sum(data["heads"]) + np.sum(data["mlp"]) + data["rest"]
    assert parts == pytest.approx(data["logit_diff"], abs=1e-4)
    assert data["prompt"] == PROMPT and data["answer"] == "e" and data["wrong"] == "s"
    lines = format_attribution(result).splitlines()
    assert lines[1] == f"embed {result.embed:+.4f}"
    assert lines[2].split() == ["layer", "head", "0", "head", "1", "head", "2", "head", "3", "mlp"]
    row = [float(v) for v in lines[4].split()[1:]]
    np.testing.assert_allclose(row, [*result.heads[1], result.mlp[1]], atol=1e-4)
