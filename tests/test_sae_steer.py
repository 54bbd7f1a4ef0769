"""`llmcli.inspection.sae.steer`: steering adds a feature's direction, ablation takes a feature
out, both at the SAE's hook point, in `sample --steer` and `eval --ablate-feature` as by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from model_helpers import assert_close
from sae_helpers import HOOK, small_run, trained_sae

from llmcli.errors import InputError
from llmcli.evaluation.run import EvalOptions, evaluate_run
from llmcli.evaluation.text import eval_tokens, window_batches, window_starts
from llmcli.generation.batching import SampleOptions, sample_texts
from llmcli.generation.sample import sample_run
from llmcli.inspection.sae.folder import load_sae
from llmcli.inspection.sae.points import as_rows
from llmcli.inspection.sae.steer import ablation_hooks, steering_hooks
from llmcli.runs.loading import load_run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    return small_run(tmp_path_factory.mktemp("run") / "run", small_corpus)


@pytest.fixture(scope="module")
def folder(run, tmp_path_factory):
    return trained_sae(run, tmp_path_factory.mktemp("sae") / "sae", steps=10)


def test_steering_adds_the_scaled_direction_and_ablation_removes_the_feature(run, folder) -> None:
    model, sae = load_run(run).model, load_sae(folder).sae
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0)) * 3
    [(name, fns)] = steering_hooks(model, [f"{folder}:7=2.5", f"{folder}:3=-1"]).items()
    assert name == HOOK and len(fns) == 2
    expected = x + 2.5 * sae.W_dec[7] - sae.W_dec[3]
    assert_close(fns[1](fns[0](x)), expected, "steer")
    [[fn]] = ablation_hooks(model, [f"{folder}:7"]).values()
    acts = sae.encode(as_rows(x))[:, 7].view(2, 5, 1)  # (B, T, 1)
    assert_close(fn(x), x - acts * sae.W_dec[7], "ablate")


def test_sample_steer_generates_as_the_hand_hooked_model_does(run, folder) -> None:
    settings = {"temperature": 0.0, "max_new_tokens": 12}
    hooks = lambda model: steering_hooks(model, [f"{folder}:7=20"])  # noqa: E731 (as the CLI's)
    steered = sample_run(run, ["the "], settings, hooks=hooks)
    plain = sample_run(run, ["the "], settings)
    loaded = load_run(run)
    direction = load_sae(folder).sae.W_dec[7].detach()
    config = dataclasses.replace(loaded.config.sample, **settings)
    options = SampleOptions(stop_ids=(loaded.tokenizer.eot_id,))
    with torch.no_grad(), loaded.model.hooks({HOOK: lambda h: h + 20 * direction}):
        [by_hand] = sample_texts(loaded.model, loaded.tokenizer, ["the "], config, options)
    assert steered[0].completion == by_hand.completion != plain[0].completion


def test_eval_ablate_feature_scores_the_hand_hooked_model(run, folder) -> None:
    specs = (f"{folder}:7", f"{folder}:1")
    options = EvalOptions(steps=2, batch_size=4, ablate_feature=specs)
    # The command line's composition: evaluation takes hooks made from the model it loads.
    result = evaluate_run(run, None, options, hooks=lambda model: ablation_hooks(model, specs))
    assert result.ablate_feature == list(specs)
    loaded = load_run(run)
    sae = load_sae(folder).sae
    tokens, _ = eval_tokens(loaded)
    nats, n = 0.0, 0

    def remove(h):  # (B, T, C)
        acts = sae.encode(h.reshape(-1, 16)).view(*h.shape[:2], -1)
        return h - acts[..., 7:8] * sae.W_dec[7] - acts[..., 1:2] * sae.W_dec[1]

    starts = window_starts(len(tokens), 16, 4, 2)
    with torch.no_grad(), loaded.model.hooks({HOOK: remove}):
        for x, y in window_batches(tokens, 16, starts, "cpu"):
            logits, _ = loaded.model(x)
            nats += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            n += y.numel()
    assert math.isclose(result.loss, nats / n, rel_tol=1e-6)
    assert result.loss != evaluate_run(run, None, EvalOptions(steps=2, batch_size=4)).loss
    with pytest.raises(ValueError, match="pass the hooks too"):
        evaluate_run(run, None, options)  # features named, none removed: a caller's mistake


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("{folder}", "write SAE_DIR:FEATURE=SCALE"),
        ("{folder}:7", "write SAE_DIR:FEATURE=SCALE"),
        ("{folder}:7=big", "SCALE must be a number"),
        ("{folder}:7=inf", "SCALE must be a finite number"),
        ("{folder}:64=1", "feature 64 is past the SAE's last \\(63\\)"),
        ("{folder}/nothing:1=1", "holds no cfg.json"),
    ],
)
def test_a_bad_steer_is_named(run, folder, spec, words) -> None:
    model = load_run(run).model
    with pytest.raises(InputError, match=words):
        steering_hooks(model, [spec.format(folder=folder)])
    with pytest.raises(InputError, match="write SAE_DIR:FEATURE \\("):
        ablation_hooks(model, [f"{folder}:1=2"])
