"""The plain sampling loop (llmcli/generation/loop.py), and the engine that `llmcli sample` and
`llmcli serve` run (llmcli/generation/engine.py: batched, KV-cached, left-padded, with the
`FastDecoder` step) against it token for token under the `exact` context policy, the loop's
sliding window: greedy and sampled with top-k and top-p, past the context, prompts of different
lengths each alone through the loop and together through the engine."""

from __future__ import annotations

import pytest
import torch
from test_engine import CONTEXT, make_model, sample_config

from llmcli.generation import loop
from llmcli.generation.engine import generate_ids
from llmcli.generation.fast_decode import FastDecoder
from llmcli.generation.sampling import sample_next

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=3),
    dict(temperature=0.8, top_k=10, top_p=0.9, seed=11),
]
SETTING_IDS = ["greedy", "sampled", "top-k-p"]
# 1 to 11 tokens (context_length 8: the last one starts past it), each past the context after
# 24 new tokens.
PROMPTS = [[4, 9, 1], [2], list(range(1, 12)), [5] * CONTEXT, [7, 7, 3, 1, 30, 2]]


def by_the_loop(model, prompt, n, *, temperature, top_k=None, top_p=1.0, seed=0) -> list[int]:
    """The new tokens of `prompt` alone through the plain loop, drawn from a generator seeded
    `seed`."""
    g = torch.Generator().manual_seed(seed)
    out = loop.generate(model, torch.tensor([prompt]), n, g, temperature, top_k, top_p)
    return out[0, len(prompt) :].tolist()


def test_the_loop_appends_max_new_tokens_after_the_prompts() -> None:
    model = make_model()
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out = loop.generate(model, idx, 12, torch.Generator().manual_seed(0))
    assert out.shape == (2, 15) and torch.equal(out[:, :3], idx)
    assert loop.generate(model, idx, 0).equal(idx)


def test_the_loop_is_the_crop_forward_draw_append_loop_written_out() -> None:
    """Each step draws from the forward of the last context_length tokens, at its last position:
    replayed here one step at a time from the loop's own output."""
    model = make_model()
    prompt = [4, 9, 1]
    out = loop.generate(model, torch.tensor([prompt]), 20, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for t in range(len(prompt), out.shape[1]):
            window = out[:, max(0, t - CONTEXT) : t]  # (1, <= 8)
            logits, _ = model(window)
            assert sample_next(logits[:, -1], g).item() == out[0, t].item()


def test_temperature_zero_is_greedy_whatever_the_generator() -> None:
    model = make_model()
    runs = [by_the_loop(model, [1, 2, 3], 12, temperature=0.0, seed=s) for s in (0, 1, 99)]
    assert runs[0] == runs[1] == runs[2]
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    loop.generate(model, torch.tensor([[1, 2, 3]]), 4, g, temperature=0.0)
    assert torch.equal(g.get_state(), state)  # no random number drawn


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
def test_the_engine_draws_the_loops_tokens_for_prompts_alone_and_together(
    pos_emb, settings
) -> None:
    """Row b of the engine's batch, seeded `seed + b`, is prompt b alone through the loop with a
    generator seeded `seed + b`: through the cache and the `FastDecoder` step as `llmcli sample`
    runs it (the default step), and through the model's forward."""
    model = make_model(pos_emb)
    seed = settings.get("seed", 0)
    alone = [
        by_the_loop(model, prompt, 24, **{**settings, "seed": seed + b})
        for b, prompt in enumerate(PROMPTS)
    ]
    config = sample_config(24, context_policy="exact", **settings)
    for decode in (FastDecoder.for_model(model), None):
        assert generate_ids(model, PROMPTS, config, decode=decode) == alone, decode
    assert generate_ids(model, PROMPTS, config) == alone  # the default step ("auto")
    for b, prompt in enumerate(PROMPTS):  # and each prompt alone through the engine
        one = sample_config(24, context_policy="exact", **{**settings, "seed": seed + b})
        decode = FastDecoder.for_model(model)
        assert generate_ids(model, [prompt], one, decode=decode) == [alone[b]], f"prompt {b}"


def test_a_batch_of_equal_prompts_through_the_loop_is_the_engines_greedy_batch() -> None:
    model = make_model("rope")
    prompts = [[4, 9, 1], [2, 2, 2], [30, 1, 7]]
    out = loop.generate(model, torch.tensor(prompts), 20, temperature=0.0)  # (3, 23)
    config = sample_config(20, context_policy="exact", temperature=0.0)
    decode = FastDecoder.for_model(model)
    assert generate_ids(model, prompts, config, decode=decode) == out[:, 3:].tolist()
