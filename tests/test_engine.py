"""The generation engine (llmcli/generation/engine.py): seeds, validation, the KV cache's steps,
padded batches against prompts alone; the context policies past context_length (`exact` against a
plain crop-and-recompute loop, `shift` against a plain keep-and-recompute loop, padded batches of
either against each prompt alone, the window's model inputs, the checks); one prefill per
distinct prompt (against every row prefilled and each prompt alone, the rows it runs); left padding
(`padded_mask` and `padded_positions` against their definitions written out, and the model under
them: a padded batch row computes what that prompt computes alone, and nothing is NaN). The
engine against the plain loop of llmcli/generation/loop.py: test_loop.py; the opt-in `decode`
step: test_fast_decode.py."""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
from model_helpers import RECIPE_OPTIONS, assert_close, gen, left_padded, randomize_, tiny_model

from llmcli.config import ModelConfig, SampleConfig
from llmcli.errors import InputError
from llmcli.generation import engine
from llmcli.generation.engine import (
    ContextWindow,
    distinct_rows,
    generate,
    generate_ids,
    padded_mask,
    padded_positions,
)
from llmcli.generation.fast_decode import FastDecoder
from llmcli.generation.sampling import sample_next
from llmcli.model.gpt import Transformer
from llmcli.model.kv_cache import KVCache

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


def spy_on_forward(model) -> list[tuple[int, bool]]:
    """The (positions, with a KV cache) of each forward call the model gets from now on."""
    lengths: list[tuple[int, bool]] = []
    forward = model.forward

    def spy(idx, *args, **kwargs):
        lengths.append((idx.shape[1], kwargs.get("kv_cache") is not None))
        return forward(idx, *args, **kwargs)

    model.forward = spy
    return lengths


def test_cache_feeds_one_token_per_step_until_the_window_slides() -> None:
    model = make_model()
    lengths: list = spy_on_forward(model)
    config = sample_config(10, temperature=0.0, context_policy="exact")
    plain = generate_ids(model, [[1, 2, 3]], config, decode=None)  # every step a forward
    # prefill 3, five single tokens (sequence reaches 8 = context), then the sliding window.
    assert lengths == [(3, True)] + [(1, True)] * 5 + [(8, False)] * 4
    # With a `decode` step (by default the fast one) the single tokens go through it instead.
    lengths.clear()
    decoder = FastDecoder.for_model(model)

    def decode(idx, cache, mask, input_pos):
        lengths.append(("decode", cache.length))
        return decoder(idx, cache, mask, input_pos)

    assert generate_ids(model, [[1, 2, 3]], config, decode=decode) == plain
    assert lengths == [(3, True)] + [("decode", n) for n in range(3, 8)] + [(8, False)] * 4


def test_a_prompt_of_exactly_context_length_is_seen_whole_then_the_window_slides() -> None:
    """A prompt that fills the context: the first step sees all of it, uncropped, and every
    later one slides the window, so no KV cache is filled; one token shorter, the cache serves
    the prefill and one decode step before the window slides."""
    model = make_model()
    short = [(CONTEXT - 1, True), (1, True), (CONTEXT, False), (CONTEXT, False)]
    cases = [
        (list(range(1, CONTEXT + 1)), [(CONTEXT, False)] * 4),
        (list(range(1, CONTEXT)), short),
    ]
    expected = [reference(model, p, 4, policy="exact", temperature=0.0) for p, _ in cases]
    lengths = spy_on_forward(model)
    config = sample_config(4, temperature=0.0, context_policy="exact")
    for (prompt, forwards), tokens in zip(cases, expected, strict=True):
        lengths.clear()
        assert generate_ids(model, [prompt], config, decode=None) == [tokens]
        assert lengths == forwards, len(prompt)


# ----------------------------------------------------------------------------- batches


PROMPTS = [[3], [1, 2, 3, 4, 5], list(range(1, 13)), [7, 7, 2]]  # 12 > context_length


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("settings", SETTINGS, ids=["greedy", "sampled", "top-k-p"])
def test_padded_batch_equals_each_prompt_alone(pos_emb, settings) -> None:
    """Each row is its prompt alone through the engine and through the plain loop (no cache,
    the whole window recomputed every step)."""
    model = make_model(pos_emb)
    seed = settings.get("seed", 0)
    config = sample_config(20, **settings)
    # 20 new tokens: the window slides, and the buffer (8 + 2 * 8 columns) is compacted.
    batch = generate_ids(model, PROMPTS, config)
    for i, prompt in enumerate(PROMPTS):
        row_settings = {**settings, "seed": seed + i}
        [alone] = generate_ids(model, [prompt], sample_config(20, **row_settings))
        assert batch[i] == alone, f"prompt {i}"
        keep = config.keep_for(CONTEXT)
        plain = reference(model, prompt, 20, policy="shift", keep=keep, **row_settings)
        assert batch[i] == plain, f"prompt {i}, the plain loop"


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


# ----------------------------------------------------------------------------- the context policies


SETTING_IDS = ["greedy", "sampled", "top-k-p"]


def reference(model, prompt, n, *, policy, keep=None, temperature, top_k=None, top_p=1.0, seed=0):
    """A plain loop: the whole visible window through `forward` at every step, no cache.

    `exact` sees the last context_length tokens; `shift` sees everything from a start that
    jumps to the last `keep` tokens whenever the window would grow past context_length.
    """
    ctx = model.context_length
    g = torch.Generator().manual_seed(seed)
    seq, start, out = list(prompt[-ctx:]), 0, []
    with torch.no_grad():
        for _ in range(n):
            if policy == "exact":
                start = max(0, len(seq) - ctx)
            elif len(seq) - start > ctx:
                start = len(seq) - keep
            logits, _ = model(torch.tensor([seq[start:]]))  # (1, T, V)
            token = int(sample_next(logits[:, -1], g, temperature, top_k, top_p))
            seq.append(token)
            out.append(token)
    return out


# ----------------------------------------------------------------------------- exact


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
def test_exact_is_the_crop_and_recompute_loop(pos_emb, settings) -> None:
    model = make_model(pos_emb)
    for prompt in ([4, 9, 1], list(range(1, 12))):  # 11 tokens start beyond context_length 8
        expected = reference(model, prompt, 20, policy="exact", **settings)
        config = sample_config(20, context_policy="exact", **settings)
        assert generate_ids(model, [prompt], config)[0] == expected


@pytest.mark.parametrize(
    ("pos_emb", "seed", "prompts", "settings"),
    [
        ("learned", 0, [[4, 9, 1], [2]], dict(temperature=0.9, seed=5)),
        (
            "rope",
            1,
            [list(range(1, 12)), [7, 7]],
            dict(temperature=0.8, top_k=10, top_p=0.9, seed=11),
        ),
    ],
    ids=["learned", "rope"],
)
def test_exact_padded_batch_equals_each_prompt_alone(pos_emb, seed, prompts, settings) -> None:
    """Row b is the crop-and-recompute loop with the seed `seed + b`, past the context too (24
    new tokens after prompts of 1 to 11 tokens, context_length 8)."""
    model = make_model(pos_emb, seed=seed)
    config = sample_config(24, context_policy="exact", **settings)
    alone = [
        reference(model, prompt, 24, policy="exact", **{**settings, "seed": settings["seed"] + i})
        for i, prompt in enumerate(prompts)
    ]
    assert generate_ids(model, prompts, config) == alone


# ----------------------------------------------------------------------------- shift


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("settings", SETTINGS[::2], ids=SETTING_IDS[::2])
@pytest.mark.parametrize("keep", [1, 4, 7])
def test_shift_is_the_keep_and_recompute_loop(pos_emb, settings, keep) -> None:
    model = make_model(pos_emb)
    for prompt in ([4, 9, 1], list(range(1, 12)), [5] * CONTEXT):
        expected = reference(model, prompt, 25, policy="shift", keep=keep, **settings)
        config = sample_config(25, context_policy="shift", context_keep=keep, **settings)
        got = generate_ids(model, [prompt], config)
        assert got[0] == expected, f"prompt {prompt}"


def test_shift_differs_from_exact_past_the_context_only() -> None:
    model = make_model()
    kw = dict(temperature=1.0, seed=2)
    [exact] = generate_ids(model, [[1, 2, 3]], sample_config(30, context_policy="exact", **kw))
    [shift] = generate_ids(model, [[1, 2, 3]], sample_config(30, context_policy="shift", **kw))
    # The sequence reaches the context (8) after 5 new tokens; the 6th is the first one that
    # sees a different window.
    assert exact[:6] == shift[:6] and exact != shift


def test_shift_prefills_the_kept_tokens_once_then_decodes() -> None:
    model = make_model()
    calls: list[int] = []
    forward = model.forward

    def spy(idx, *args, **kwargs):
        calls.append(idx.shape[1])
        return forward(idx, *args, **kwargs)

    model.forward = spy
    config = sample_config(16, temperature=0.0, context_policy="shift", context_keep=3)
    generate_ids(model, [[1, 2, 3]], config)
    # The prompt (3), then five one-token steps fill the context; then every 6 steps the last
    # 3 tokens are prefilled again.
    assert [n for n in calls if n > 1] == [3, 3, 3]


SHIFT_PROMPTS = [[3], [1, 2, 3, 4, 5], list(range(1, 13)), [7, 7, 2], list(range(9, 16))]


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("settings", SETTINGS[:2], ids=SETTING_IDS[:2])
@pytest.mark.parametrize("keep", [1, 4])
def test_shift_padded_batch_equals_each_prompt_alone(pos_emb, settings, keep) -> None:
    """Rows of 1, 3, 5, 7 and 8 tokens reach the context at different steps: each row shifts
    when its own length fills the context and the others keep all their tokens meanwhile."""
    model = make_model(pos_emb)
    seed = settings.get("seed", 0)
    kw = dict(context_policy="shift", context_keep=keep)
    config = sample_config(30, **kw, **settings)
    batch = generate_ids(model, SHIFT_PROMPTS, config)
    for i, prompt in enumerate(SHIFT_PROMPTS):
        alone = reference(
            model, prompt, 30, policy="shift", keep=keep, **{**settings, "seed": seed + i}
        )
        assert batch[i] == alone, f"prompt {i}"


def test_keep_last_keeps_full_rows_last_tokens_and_shorter_rows_whole() -> None:
    ctx = 4
    window = ContextWindow([[1, 2, 3, 4], [5, 6], [7, 8, 9]], 10, ctx, torch.device("cpu"))
    window.append(torch.tensor([10, 11, 12]))  # real lengths 5 (> ctx), 3, 4
    window.keep_last(2)
    assert window.end == 4 and window.pads == [2, 1, 0]
    idx, mask, pos = window.inputs(0)
    assert torch.equal(mask, padded_mask(torch.tensor([2, 1, 0]), 4, 4))
    real = mask[:, 0, -1]  # (B, T): the keys the newest (real) token sees
    assert [row[r].tolist() for row, r in zip(idx, real, strict=True)] == [
        [4, 10],
        [5, 6, 11],
        [7, 8, 9, 12],
    ]
    assert [p[r].tolist() for p, r in zip(pos, real, strict=True)] == [
        [0, 1],
        [0, 1, 2],
        [0, 1, 2, 3],
    ]


def test_inputs_are_the_padded_mask_and_positions_and_none_without_padding() -> None:
    window = ContextWindow([[1, 2, 3], [4]], 10, 8, torch.device("cpu"))  # pads 0, 2
    idx, mask, pos = window.inputs(0)
    assert idx.tolist() == [[1, 2, 3], [0, 0, 4]]
    pads = torch.tensor([0, 2])
    assert torch.equal(mask, padded_mask(pads, 3, 3))
    assert torch.equal(pos, padded_positions(pads, 3, 3))
    window.append(torch.tensor([5, 6]))
    idx, mask, pos = window.newest_inputs()  # the decode column after 3 cached ones
    assert idx.tolist() == [[5], [6]]
    assert torch.equal(mask, padded_mask(pads, 1, 4)) and mask.shape == (2, 1, 1, 4)
    assert pos.tolist() == [[3], [1]]
    idx, mask, pos = window.inputs(2)  # from column 2, past every padding column: as alone
    assert idx.tolist() == [[3, 5], [4, 6]] and mask is None and pos is None
    alone = ContextWindow([[1, 2, 3]], 10, 8, torch.device("cpu"))
    assert alone.inputs(0)[1:] == (None, None) and alone.newest_inputs()[1:] == (None, None)


def test_the_window_keeps_its_own_cache_bookkeeping() -> None:
    """`step` prefills the empty cache, then gives the newest column once `mark_cached` says a
    forward filled the cache; `shift` past the context starts again from the last `keep` tokens
    with the cache emptied. Without `mark_cached` nothing counts as cached."""
    model = make_model()
    cache = model.new_kv_cache(1)
    window = ContextWindow([[1, 2, 3]], 20, CONTEXT, torch.device("cpu"), cache=cache, keep=2)
    steps = []
    with torch.no_grad():
        for t in range(12):
            step = window.step()
            assert step.cache is cache
            steps.append((step.idx.shape[1], step.decode_step))
            model(step.idx, mask=step.mask, input_pos=step.input_pos, kv_cache=step.cache)
            window.mark_cached()
            assert cache.length == window.end
            window.append(torch.tensor([t % 5]))
    # The prompt (3), five decode steps fill the context (8), then the last 2 tokens again.
    assert steps == [(3, False)] + [(1, True)] * 5 + [(2, False)] + [(1, True)] * 5
    unmarked = ContextWindow([[1, 2, 3]], 5, CONTEXT, torch.device("cpu"), cache=cache)
    unmarked.step()
    unmarked.append(torch.tensor([4]))
    assert unmarked.step().idx.shape[1] == 4  # the whole window again: nothing was cached
    uncached = ContextWindow([[1, 2, 3]], 5, CONTEXT, torch.device("cpu"))
    assert uncached.step().cache is None


# ------------------------------------------------------------------- one prefill per prompt


GROUPS = [[3], [1, 2, 3, 4, 5], [7, 7, 2]]  # 1, 5 and 3 tokens: padded
# 4 samples of each, their rows mixed as the server's batches may mix them.
GROUPED = [GROUPS[i] for i in (0, 1, 2, 0, 1, 2, 2, 1, 0, 0, 1, 2)]


def every_row_prefilled(model, prompts, config, **kwargs) -> list[list[int]]:
    """`generate_ids` with every row prefilled, as before rows shared a prefill (the engine's
    window made with `share_prefill=False`)."""
    unshared = functools.partial(ContextWindow, share_prefill=False)
    with mock.patch.object(engine, "ContextWindow", unshared):
        return generate_ids(model, prompts, config, **kwargs)


def spy_on_prefills(model) -> list[torch.Tensor]:
    """The ids `(rows, T)` of every forward call over more than one position from now on."""
    seen: list[torch.Tensor] = []
    forward = model.forward

    def spy(idx, *args, **kwargs):
        if idx.shape[1] > 1:
            seen.append(idx.clone())
        return forward(idx, *args, **kwargs)

    model.forward = spy
    return seen


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("policy", ["shift", "exact"])
def test_a_shared_prefill_draws_what_every_row_prefilled_draws(pos_emb, settings, policy) -> None:
    """3 prompts x 4 samples, 20 new tokens: past context_length 8, so `shift` prefills again
    (and `exact` recomputes); each row gets what it gets with every row prefilled, and what it
    gets alone with its seed, with the model's forward or the fast decode step."""
    model = make_model(pos_emb)
    kw = dict(context_policy=policy, context_keep=3)
    config = sample_config(20, **kw, **settings)
    shared = generate_ids(model, GROUPED, config)
    assert shared == every_row_prefilled(model, GROUPED, config)
    assert shared == generate_ids(model, GROUPED, config, decode=FastDecoder.for_model(model))
    seed = settings.get("seed", 0)
    for b, prompt in enumerate(GROUPED):
        alone = sample_config(20, **kw, **{**settings, "seed": seed + b})
        assert generate_ids(model, [prompt], alone) == [shared[b]], f"row {b}"
    if settings["temperature"] > 0:  # the samples of a prompt are samples, not copies
        assert len({tuple(shared[b]) for b in (0, 3, 8, 9)}) > 1


@pytest.mark.parametrize("settings", SETTINGS[:2], ids=SETTING_IDS[:2])
def test_the_prefill_runs_once_per_distinct_prompt(settings) -> None:
    """The first prefill runs the 3 distinct prompts, not the 12 rows; a `shift` re-prefill
    runs each distinct row once too: 3 while greedy rows of a prompt stay the same, 12 once
    sampled ones differ. With `share_prefill=False` every prefill runs 12 rows."""
    model = make_model()
    prefills = spy_on_prefills(model)
    config = sample_config(20, context_policy="shift", context_keep=3, **settings)
    generate_ids(model, GROUPED, config)
    assert sorted(prefills[0].tolist()) == [[0, 0, 0, 0, 3], [0, 0, 7, 7, 2], [1, 2, 3, 4, 5]]
    again = 3 if settings["temperature"] == 0 else len(GROUPED)
    assert len(prefills) > 1 and [len(p) for p in prefills[1:]] == [again] * (len(prefills) - 1)
    count = len(prefills)
    prefills.clear()
    every_row_prefilled(model, GROUPED, config)
    assert [len(p) for p in prefills] == [len(GROUPED)] * count


def test_rows_share_a_prefill_when_their_tokens_and_padding_are_the_same() -> None:
    """[5] padded to [0, 5] has the columns of the prompt [0, 5], not its padding: two groups.
    What padding columns hold does not matter: after a `shift` two rows with the same kept
    tokens share, whatever their padding columns still hold from before."""
    rows = [[5], [0, 5], [5], [4, 5], [0, 5]]
    cache = KVCache(1, len(rows), 1, 1, 8)
    window = ContextWindow(rows, 4, 8, torch.device("cpu"), cache=cache)
    idx, mask, pos = window.inputs(0)
    step = window.step()
    assert step.groups is not None and len(step.idx) == 3
    groups = step.groups.tolist()
    assert groups[0] == groups[2] and groups[1] == groups[4] and len(set(groups)) == 3
    assert torch.equal(step.idx[step.groups], idx)
    assert torch.equal(step.mask[step.groups], mask)
    assert torch.equal(step.input_pos[step.groups], pos)
    unshared = ContextWindow(rows, 4, 8, torch.device("cpu"), cache=cache, share_prefill=False)
    step = unshared.step()
    assert step.groups is None and len(step.idx) == len(rows)
    distinct = ContextWindow([[1, 2], [2, 1]], 4, 8, torch.device("cpu"), cache=cache)
    assert distinct.step().groups is None
    # Rows 0 and 1 differ in column 2, which is padding once `shift` keeps their last 2 tokens.
    cache = KVCache(1, 3, 1, 1, 4)
    window = ContextWindow(
        [[1, 2, 3, 4], [1, 2, 9, 4], [3, 4]], 4, 4, torch.device("cpu"), cache=cache, keep=2
    )
    assert window.step().groups is None
    window.mark_cached()
    window.append(torch.tensor([7, 7, 7]))
    step = window.step()  # kept: [4, 7], [4, 7], [3, 4, 7]
    assert window.pads == [1, 1, 0] and window.tokens[:2, 0].tolist() == [3, 9]
    assert step.groups.tolist() in ([0, 0, 1], [1, 1, 0]) and len(step.idx) == 2


def test_distinct_rows_names_a_first_row_of_each_and_each_rows_group() -> None:
    rows = torch.tensor([[1, 2], [3, 4], [1, 2], [-1, 2], [3, 4]])
    first, groups = distinct_rows(rows)
    assert torch.equal(rows[first][groups], rows)
    assert sorted(first.tolist()) == [0, 1, 3]  # the first of each, once
    assert len(set(groups.tolist())) == 3


# ----------------------------------------------------------------------------- checks


def test_policy_and_keep_are_checked() -> None:
    assert SampleConfig(context_policy="shift").keep_for(64) == 32
    assert SampleConfig(context_policy="exact", context_keep=5).keep_for(64) == 5
    assert SampleConfig().keep_for(1) == 1  # a one-token context keeps its token
    with pytest.raises(
        InputError,
        match=r"--context-policy / sample\.context_policy \('slide'\) must be one of exact, shift",
    ):
        SampleConfig(context_policy="slide")  # type: ignore[arg-type]
    for keep in (0, 64, -1):
        with pytest.raises(
            InputError, match=r"--context-keep / sample\.context_keep \(.*\) must be in 1\.\.63"
        ):
            SampleConfig(context_keep=keep).keep_for(64)
    model = make_model()
    with pytest.raises(InputError, match="context_policy"):
        generate_ids(model, [[1]], sample_config(2, context_policy="nope"))
    with pytest.raises(InputError, match=r"1\.\.7"):  # a model alone: generate checks the keep
        generate_ids(model, [[1]], sample_config(2, context_policy="shift", context_keep=8))


# ----------------------------------------------------------------------------- left padding


CASES = [  # (pads, T, T_k): a prefill, a chunk after cached columns, a decode column
    ([0, 3, 7], 8, 8),
    ([2, 0, 5], 3, 9),
    ([4, 0, 9], 1, 10),
]


def reference_mask(pads: list[int], T: int, T_k: int) -> torch.Tensor:
    """`(B, 1, T, T_k)`, entry by entry: query i sits at column `T_k - T + i`; it may see a key
    at or before it that is not padding, and a padding query sees its own column alone."""
    mask = torch.zeros(len(pads), 1, T, T_k, dtype=torch.bool)
    for b, pad in enumerate(pads):
        for i in range(T):
            col = T_k - T + i
            for j in range(T_k):
                mask[b, 0, i, j] = (pad <= j <= col) if col >= pad else j == col
    return mask


@pytest.mark.parametrize(("pads", "T", "T_k"), CASES)
def test_padded_mask_is_causal_hides_padding_and_a_padding_query_sees_itself(pads, T, T_k) -> None:
    mask = padded_mask(torch.tensor(pads), T, T_k)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, reference_mask(pads, T, T_k))
    assert mask.any(dim=-1).all()  # no empty row: every query has a key


@pytest.mark.parametrize(("pads", "T", "T_k"), CASES)
def test_padded_positions_count_the_real_tokens_before(pads, T, T_k) -> None:
    expected = [[max(0, T_k - T + i - pad) for i in range(T)] for pad in pads]
    assert padded_positions(torch.tensor(pads), T, T_k).tolist() == expected


def padded_forward(model, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits `(B, T, V)` of `rows` as one left-padded batch, and the pads `(B,)`."""
    idx, pads = left_padded(rows)
    T = idx.shape[1]
    mask, pos = padded_mask(pads, T, T), padded_positions(pads, T, T)
    with torch.no_grad():
        logits, _ = model(idx, mask=mask, input_pos=pos)
    return logits, pads


@pytest.mark.parametrize("opts", RECIPE_OPTIONS.values(), ids=RECIPE_OPTIONS.keys())
def test_a_padded_batch_row_equals_that_prompt_alone(opts) -> None:
    model = randomize_(tiny_model(**opts))
    rows = [torch.randint(37, (n,), generator=gen(n)) for n in (3, 16, 7, 1)]
    logits, pads = padded_forward(model, rows)
    tag = ",".join(opts) or "default"
    for b, row in enumerate(rows):
        with torch.no_grad():
            alone, _ = model(row[None])  # (1, n, V), the model's causal defaults
        real = logits[b, pads[b] :]  # (n, V)
        if pads[b] == 0:  # the same keys, the same sums: bit for bit
            assert torch.equal(real, alone[0]), f"row {b} without padding [{tag}]"
        else:  # softmax and weighted sums over more (masked) keys: rounding only
            assert_close(real, alone[0], f"padded row {b} vs alone [{tag}]", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("opts", RECIPE_OPTIONS.values(), ids=RECIPE_OPTIONS.keys())
def test_what_the_padding_holds_changes_no_bit_of_the_real_positions(opts) -> None:
    """Masked keys get weight exactly 0: other tokens in the padding columns leave every logit
    of a real position the same, bit for bit (and a row alone with its padding equals it in
    the batch)."""
    model = randomize_(tiny_model(**opts))
    rows = [torch.randint(37, (n,), generator=gen(n)) for n in (3, 11, 6)]
    idx, pads = left_padded(rows)
    T = idx.shape[1]
    mask, pos = padded_mask(pads, T, T), padded_positions(pads, T, T)
    other = idx.clone()
    real = torch.arange(T)[None, :] >= pads[:, None]  # (B, T)
    other[~real] = torch.randint(37, (int((~real).sum()),), generator=gen(9))
    with torch.no_grad():
        logits, _ = model(idx, mask=mask, input_pos=pos)
        changed, _ = model(other, mask=mask, input_pos=pos)
        single, _ = model(idx[:1], mask=mask[:1], input_pos=pos[:1])
    assert torch.equal(changed[real], logits[real])
    assert not torch.equal(changed[~real], logits[~real])  # the padding columns themselves did
    assert torch.equal(single[0], logits[0])


def test_a_row_of_padding_only_gives_finite_logits_and_gradients() -> None:
    model = randomize_(tiny_model())
    model.train()  # dropout is 0: the forward of training, for the gradients
    idx = torch.randint(37, (2, 8), generator=gen(1))
    pads = torch.tensor([8, 3])  # row 0: nothing but padding
    logits, _ = model(idx, mask=padded_mask(pads, 8, 8), input_pos=padded_positions(pads, 8, 8))
    assert torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
