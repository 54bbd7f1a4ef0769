"""`llmcli.inspection.sae.evaluate`: every figure of `sae eval` against a forward run by hand,
block by block, with the SAE's reconstruction (or zeros, or the mean) put in at the hook point."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sae_helpers import numpy_decode, numpy_encode, small_run, trained_sae

from llmcli.errors import CheckpointError, InputError
from llmcli.evaluation.text import eval_tokens, window_batches, window_starts
from llmcli.inspection.sae.evaluate import ReadOptions, evaluate_sae, format_eval
from llmcli.inspection.sae.folder import load_sae
from llmcli.runs.loading import load_run

pytestmark = pytest.mark.usefixtures("one_thread")
HOOK = "blocks.0.resid_post"


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    return small_run(tmp_path_factory.mktemp("run") / "run", small_corpus)


@pytest.fixture(scope="module")
def folder(run, tmp_path_factory):
    return trained_sae(run, tmp_path_factory.mktemp("sae") / "sae", hook=HOOK, steps=20)


def by_hand(model, x, y, replace):
    """The mean loss with block 0's output replaced by `replace(output)`, blocks run by hand."""
    h = model.blocks[0](model.embedding(x))  # (B, T, C): blocks.0.resid_post
    h = replace(h)
    logits = model.to_logits(model.blocks[1](h))
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item(), h


def test_every_figure_equals_the_hand_run_forward(run, folder) -> None:
    result = evaluate_sae(ReadOptions(sae=folder, steps=3, batch_size=4, device="cpu"))
    loaded = load_run(run)
    model = loaded.model
    tokens, _ = eval_tokens(loaded)
    starts = window_starts(len(tokens), 16, 4, 3)
    batches = list(window_batches(tokens, 16, starts, "cpu"))
    sae = load_sae(folder).sae
    p = {k: v.detach().double().numpy() for k, v in sae.state_dict().items()}
    rows = []
    clean = 0.0
    with torch.no_grad():
        for x, y in batches:
            nats, h = by_hand(model, x, y, lambda h: h)
            clean += nats
            rows.append(h.reshape(-1, 16).double().numpy())
        X = np.concatenate(rows)  # (N, C)
        acts = numpy_encode(X, p["W_enc"], p["b_enc"], p["b_dec"], k=4)
        recon = numpy_decode(acts, p["W_dec"], p["b_dec"])
        mean = X.mean(0)

        def with_numpy(fn):
            total = 0.0
            for x, y in batches:
                total += by_hand(model, x, y, lambda h: fn(h))[0]
            return total / len(X)

        def spliced(h):
            r = h.reshape(-1, 16).double().numpy()
            a = numpy_encode(r, p["W_enc"], p["b_enc"], p["b_dec"], k=4)
            out = numpy_decode(a, p["W_dec"], p["b_dec"])
            return torch.from_numpy(out).float().view(h.shape)

        ce_sae = with_numpy(spliced)
        ce_zero = with_numpy(torch.zeros_like)
        ce_mean = with_numpy(lambda h: torch.from_numpy(mean).float().expand_as(h))
    ce_clean = clean / len(X)
    expected = {
        "tokens": len(X),
        "explained_variance": 1 - ((recon - X) ** 2).sum() / ((X - mean) ** 2).sum(),
        "l0": (acts > 0).sum(1).mean(),
        "dead_fraction": ((acts > 0).sum(0) == 0).mean(),
        "ce_clean": ce_clean,
        "ce_sae": ce_sae,
        "ce_zero": ce_zero,
        "ce_mean": ce_mean,
        "ce_recovered": (ce_zero - ce_sae) / (ce_zero - ce_clean),
        "ce_recovered_mean": (ce_mean - ce_sae) / (ce_mean - ce_clean),
    }
    got = result.to_dict()
    for key, value in expected.items():
        assert math.isclose(got[key], value, rel_tol=1e-4, abs_tol=1e-5), (key, got[key], value)
    assert result.hook == HOOK and result.features == 64
    assert "ce_recovered" in format_eval(result)


def test_the_sae_and_its_run_are_found_from_either(run, folder) -> None:
    """--sae alone: the SAE's own run; --checkpoint alone: the SAE written last in the run."""
    by_sae = evaluate_sae(ReadOptions(sae=folder, steps=1, batch_size=2))
    assert by_sae.run == str(run)
    with pytest.raises(CheckpointError, match="no SAE under"):
        evaluate_sae(ReadOptions(checkpoint=run, steps=1))
    inside = trained_sae(run, run / "sae" / "mine", steps=1)
    assert evaluate_sae(ReadOptions(checkpoint=run, steps=1)).sae == str(inside)
    with pytest.raises(InputError, match="--steps"):
        ReadOptions(steps=0)
