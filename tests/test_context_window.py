"""The context policies past context_length (llmcli/generation/context_window.py): `exact`
against a plain crop-and-recompute loop, `shift` against a plain keep-and-recompute loop, padded
batches of either against each prompt alone, the window's model inputs (the mask and positions of
llmcli/generation/padding.py), and the checks."""

from __future__ import annotations

import pytest
import torch
from test_generate import CONTEXT, make_model, sample_config

from llmcli.config import SampleConfig
from llmcli.errors import InputError
from llmcli.generation.context_window import ContextWindow
from llmcli.generation.generate import generate_ids
from llmcli.generation.padding import padded_mask, padded_positions
from llmcli.generation.sampling import sample_next

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=3),
    dict(temperature=0.8, top_k=10, top_p=0.9, seed=11),
]
SETTING_IDS = ["greedy", "sampled", "top-k-p"]


def reference(model, prompt, n, *, policy, keep=None, temperature, top_k=None, top_p=1.0, seed=0):
    """A plain loop: the whole visible window through `forward` at every step, no cache.

    `exact` sees the last context_length tokens; `shift` sees everything from a start that
    jumps to the last `keep` tokens whenever the window would grow past context_length.
    """
    C = model.context_length
    g = torch.Generator().manual_seed(seed)
    seq, start, out = list(prompt[-C:]), 0, []
    with torch.no_grad():
        for _ in range(n):
            if policy == "exact":
                start = max(0, len(seq) - C)
            elif len(seq) - start > C:
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
        for use_cache in (True, False):
            config = sample_config(20, context_policy="exact", **settings)
            got = generate_ids(model, [prompt], config, use_cache=use_cache)
            assert got[0] == expected


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
    for use_cache in (True, False):
        assert generate_ids(model, prompts, config, use_cache=use_cache) == alone, use_cache


# ----------------------------------------------------------------------------- shift


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("settings", SETTINGS[::2], ids=SETTING_IDS[::2])
@pytest.mark.parametrize("keep", [1, 4, 7])
def test_shift_is_the_keep_and_recompute_loop(pos_emb, settings, keep) -> None:
    model = make_model(pos_emb)
    for prompt in ([4, 9, 1], list(range(1, 12)), [5] * CONTEXT):
        expected = reference(model, prompt, 25, policy="shift", keep=keep, **settings)
        for use_cache in (True, False):
            config = sample_config(25, context_policy="shift", context_keep=keep, **settings)
            got = generate_ids(model, [prompt], config, use_cache=use_cache)
            assert got[0] == expected, f"prompt {prompt}, use_cache={use_cache}"


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


PROMPTS = [[3], [1, 2, 3, 4, 5], list(range(1, 13)), [7, 7, 2], list(range(9, 16))]


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("settings", SETTINGS[:2], ids=SETTING_IDS[:2])
@pytest.mark.parametrize("keep", [1, 4])
@pytest.mark.parametrize("use_cache", [True, False])
def test_shift_padded_batch_equals_each_prompt_alone(pos_emb, settings, keep, use_cache) -> None:
    """Rows of 1, 3, 5, 7 and 8 tokens reach the context at different steps: each row shifts
    when its own length fills the context and the others keep all their tokens meanwhile."""
    model = make_model(pos_emb)
    seed = settings.get("seed", 0)
    kw = dict(context_policy="shift", context_keep=keep)
    batch = generate_ids(model, PROMPTS, sample_config(30, **kw, **settings), use_cache=use_cache)
    for i, prompt in enumerate(PROMPTS):
        alone = reference(
            model, prompt, 30, policy="shift", keep=keep, **{**settings, "seed": seed + i}
        )
        assert batch[i] == alone, f"prompt {i}"


def test_keep_last_keeps_full_rows_last_tokens_and_shorter_rows_whole() -> None:
    C = 4
    window = ContextWindow([[1, 2, 3, 4], [5, 6], [7, 8, 9]], 10, C, torch.device("cpu"))
    window.append(torch.tensor([10, 11, 12]))  # real lengths 5 (> C), 3, 4
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
