"""`llmcli sample`'s library side (llmcli/generation/sample.py): `sample_run` on a saved run, a
sample ending at the end-of-text token unless `ignore_eos`, and the hook functions it is given."""

from __future__ import annotations

import pytest
from conftest import save_tiny_run

from llmcli.data.tokenizer import CharTokenizer
from llmcli.errors import ConfigError, InputError
from llmcli.generation.sample import sample_run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_sample_ends_at_the_end_of_text_token_unless_ignore_eos(tmp_path) -> None:
    tokenizer = CharTokenizer("ab \n")  # 5 ids: the end-of-text token is 1 in 5 at random
    raw = {"model": {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 16}}
    run = save_tiny_run(tmp_path / "run", tokenizer, raw)
    for seed in range(20):
        settings = {"seed": seed, "max_new_tokens": 30, "temperature": 1.0, "top_k": None}
        (stopped,) = sample_run(run, ["a"], settings)
        (going,) = sample_run(run, ["a"], {**settings, "ignore_eos": True})
        assert going.stop_reason == "length" and going.tokens == 30
        if stopped.stop_reason == "stop":  # the model wrote the token: the rows part there
            assert stopped.tokens < 30 and tokenizer.eot not in stopped.completion
            assert going.completion.startswith(stopped.completion + tokenizer.eot)
            break
    else:
        pytest.fail("no seed of 20 drew the end-of-text token")
    with pytest.raises(ConfigError, match=r"--ignore-eos / sample.ignore_eos \('yes'\)"):
        sample_run(run, ["a"], {"ignore_eos": "yes"})


def test_sample_run_runs_the_hook_functions_it_is_given_on_the_loaded_model(tmp_path) -> None:
    tokenizer = CharTokenizer("ab \n")
    raw = {"model": {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 16}}
    run = save_tiny_run(tmp_path / "run", tokenizer, raw)
    settings = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    models, steps = [], []

    def hooks(model):
        models.append(model)
        return {"embed": [lambda x: steps.append(x.shape[1])]}  # reads, replaces nothing

    out: list[str] = []
    [hooked] = sample_run(run, ["ab"], settings, hooks=hooks, write=out.append)
    [plain] = sample_run(run, ["ab"], settings)
    assert hooked.completion == plain.completion and "".join(out) == f"ab{plain.completion}\n"
    # Made once for the loaded model; a hook at work makes every step the model's forward: the
    # prompt, then one token per step.
    assert len(models) == 1 and steps == [2, 1, 1, 1, 1, 1]
    assert not any(point.fns for point in models[0].modules() if hasattr(point, "fns"))

    def refused(model):
        raise InputError("--steer 'x': write SAE_DIR:FEATURE=SCALE.")

    out.clear()
    with pytest.raises(InputError, match="--steer 'x'"):
        sample_run(run, ["ab"], settings, hooks=refused, write=out.append)
    assert out == ["ab"]  # before any sample: only the prompt, written as the stream starts
