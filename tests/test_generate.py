"""Generation (llmcli/generation/generate.py): seeds, validation, the KV cache's steps, padded
batches against prompts alone. The context policies past context_length: test_context_window.py;
the opt-in `decode` step: test_fast_decode.py."""

from __future__ import annotations

import pytest
import torch

from llmcli.config import ModelConfig, SampleConfig
from llmcli.errors import InputError
from llmcli.generation.fast_decode import FastDecoder
from llmcli.generation.generate import generate, generate_ids
from llmcli.generation.sampling import sample_next
from llmcli.model.gpt import Transformer

CONTEXT = 8


pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(pos_emb: str = "learned", seed: int = 0, vocab: int = 40) -> Transformer:
    """A tiny random Transformer with sharpened weights, so that logits are far from ties."""
    g = torch.Generator().manual_seed(seed)
    config = ModelConfig(n_layer=2, n_head=2, n_embed=16, context_length=CONTEXT, pos_emb=pos_emb)
    model = Transformer(config, vocab, generator=g)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(8.0)
    return model.eval()


def sample_config(max_new_tokens: int, **settings) -> SampleConfig:
    """Settings for `generate`: plain sampling (temperature 1, every token kept) unless
    `settings` say otherwise."""
    return SampleConfig(
        max_new_tokens=max_new_tokens, **{"temperature": 1.0, "top_k": None, **settings}
    )


def reference_generate(model, prompt, n, *, temperature, top_k=None, top_p=1.0, seed=0):
    """The nanoGPT loop: recompute the whole window (last context_length tokens) every step."""
    g = torch.Generator().manual_seed(seed)
    seq = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            window = torch.tensor([seq[-model.context_length :]])  # (1, T)
            logits, _ = model(window)
            tok = int(sample_next(logits[:, -1], g, temperature, top_k, top_p))
            seq.append(tok)
            out.append(tok)
    return out


def test_temperature_zero_is_greedy_and_ignores_the_generator() -> None:
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(123)
    state = g.get_state()
    for top_k, top_p in [(None, 1.0), (3, 0.5)]:
        assert torch.equal(sample_next(logits, g, 0.0, top_k, top_p), logits.argmax(-1))
    assert torch.equal(g.get_state(), state)  # no random number drawn
    model = make_model()
    runs = [
        generate_ids(model, [[1, 2, 3]], sample_config(12, temperature=0.0, seed=s))
        for s in (0, 1, 99)
    ]
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][0] == reference_generate(model, [1, 2, 3], 12, temperature=0.0)


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    model = make_model()
    kw = dict(temperature=1.0, top_k=20)
    a = generate_ids(model, [[5, 6]], sample_config(20, seed=7, **kw))
    assert a == generate_ids(model, [[5, 6]], sample_config(20, seed=7, **kw))
    assert a != generate_ids(model, [[5, 6]], sample_config(20, seed=8, **kw))


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_k=0),
        dict(top_k=-3),
        dict(top_p=0.0),
        dict(top_p=1.01),
        dict(top_p=-0.5),
    ],
)
def test_bad_controls_raise_input_error(bad) -> None:
    args = {"temperature": 1.0, "top_k": None, "top_p": 1.0, **bad}
    name = next(iter(bad))
    with pytest.raises(InputError, match=name):
        SampleConfig(**args)
    with pytest.raises(InputError, match=name):
        next(generate(make_model(), [[1]], sample_config(3, **args)))


# ----------------------------------------------------------------------------- KV cache


SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=3),
    dict(temperature=0.8, top_k=10, top_p=0.9, seed=11),
]


def test_cache_feeds_one_token_per_step_until_the_window_slides() -> None:
    model = make_model()
    lengths = []
    forward = model.forward

    def spy(idx, *args, **kwargs):
        lengths.append((idx.shape[1], kwargs.get("kv_cache") is not None))
        return forward(idx, *args, **kwargs)

    model.forward = spy
    config = sample_config(10, temperature=0.0, context_policy="exact")
    plain = generate_ids(model, [[1, 2, 3]], config)
    # prefill 3, five single tokens (sequence reaches 8 = context), then the sliding window.
    assert lengths == [(3, True)] + [(1, True)] * 5 + [(8, False)] * 4
    # With a `decode` step the single tokens go through it instead of `forward`.
    lengths.clear()
    decoder = FastDecoder.for_model(model)

    def decode(idx, cache, mask, input_pos):
        lengths.append(("decode", cache.length))
        return decoder(idx, cache, mask, input_pos)

    assert generate_ids(model, [[1, 2, 3]], config, decode=decode) == plain
    assert lengths == [(3, True)] + [("decode", n) for n in range(3, 8)] + [(8, False)] * 4


# ----------------------------------------------------------------------------- batches


PROMPTS = [[3], [1, 2, 3, 4, 5], list(range(1, 13)), [7, 7, 2]]  # 12 > context_length


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("settings", SETTINGS, ids=["greedy", "sampled", "top-k-p"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_padded_batch_equals_each_prompt_alone(pos_emb, settings, use_cache) -> None:
    model = make_model(pos_emb)
    seed = settings.get("seed", 0)
    # 20 new tokens: the window slides, and the buffer (8 + 2 * 8 columns) is compacted.
    batch = generate_ids(model, PROMPTS, sample_config(20, **settings), use_cache=use_cache)
    for i, prompt in enumerate(PROMPTS):
        [alone] = generate_ids(model, [prompt], sample_config(20, **{**settings, "seed": seed + i}))
        assert batch[i] == alone, f"prompt {i}"


def test_generate_streams_one_column_per_step() -> None:
    model = make_model()
    config = sample_config(5, temperature=1.0, seed=0)
    steps = list(generate(model, PROMPTS, config))
    assert len(steps) == 5 and all(s.shape == (len(PROMPTS),) for s in steps)
    assert torch.stack(steps, 1).tolist() == generate_ids(model, PROMPTS, config)


def test_bad_prompts_raise_input_error() -> None:
    model = make_model()
    with pytest.raises(InputError, match="no tokens"):
        generate_ids(model, [[1], []], sample_config(2))
    with pytest.raises(InputError, match="outside the model's vocabulary"):
        generate_ids(model, [[1, 40]], sample_config(2))


def test_observe_sees_each_steps_logits_and_the_ids_drawn() -> None:
    model = make_model()
    prompts = [[3, 4], [1, 2, 3, 4, 5]]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    config = sample_config(3, temperature=1.0, seed=0)  # 5 + 3 tokens: inside the context
    steps = list(generate(model, prompts, config, observe=lambda lg, ids: seen.append((lg, ids))))
    assert len(seen) == 3
    assert all(torch.equal(ids, step) for (_, ids), step in zip(seen, steps, strict=True))
    for b, prompt in enumerate(prompts):  # a plain forward of the row alone, no cache
        row = prompt + [int(s[b]) for s in steps]
        with torch.no_grad():
            logits, _ = model(torch.tensor([row]))
        for t, (step_logits, _) in enumerate(seen):
            want = logits[0, len(prompt) + t - 1]  # the logits the step drew row b's token from
            torch.testing.assert_close(step_logits[b], want, atol=1e-5, rtol=1e-5)
