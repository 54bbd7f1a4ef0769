"""Sampling and generation (llmcli/generate.py): controls on hand-made logits, seeds, KV cache
against full recomputation (also past context_length), padded batches against prompts alone,
stop strings, streaming order and prompt files."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from llmcli.errors import InputError
from llmcli.generate import (
    OrderedWriter,
    _inverse_cdf,
    _TextState,
    check_sampling,
    filter_probs,
    format_samples,
    generate,
    generate_ids,
    read_prompts,
    sample_next,
    sample_texts,
    unescape,
)
from llmcli.model import Transformer
from llmcli.tokenizer import BPETokenizer, CharTokenizer

CONTEXT = 8


pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(pos_emb: str = "learned", seed: int = 0, vocab: int = 40) -> Transformer:
    """A tiny random Transformer with sharpened weights, so that logits are far from ties."""
    g = torch.Generator().manual_seed(seed)
    model = Transformer(vocab, 2, 2, 16, CONTEXT, pos_emb=pos_emb, generator=g)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(8.0)
    return model.eval()


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


# ----------------------------------------------------------------------------- controls


def numpy_filter(logits, temperature, top_k=None, top_p=1.0):
    """Reference: softmax(logits / T), keep the k best (lowest id on ties), then the smallest
    set of most likely tokens whose mass reaches top_p; renormalise."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = order[: top_k if top_k is not None else len(x)]
    p = np.exp(x[keep] - x[keep].max())
    p /= p.sum()
    if top_p < 1.0:
        n = int(np.searchsorted(np.cumsum(p), top_p - 1e-12)) + 1  # smallest n with cum >= p
        keep, p = keep[:n], p[:n] / p[:n].sum()
    out = np.zeros(len(x))
    out[keep] = p
    return out


@pytest.mark.parametrize(
    ("logits", "temperature", "top_k", "top_p"),
    [
        ([1.0, 3.0, 3.0, 3.0, 0.0, 2.0], 1.0, 2, 1.0),  # ties at the top: exactly 2 kept
        ([1.0, 3.0, 3.0, 3.0, 0.0, 2.0], 0.7, 4, 1.0),  # the 4th is the single 2.0
        ([2.0, 2.0, 2.0, 2.0], 1.0, 3, 1.0),  # all tied: the 3 lowest ids
        ([0.5, -1.0, 2.0, 0.1], 2.5, None, 1.0),  # temperature alone
        ([0.5, -1.0, 2.0, 0.1], 1.0, 10, 1.0),  # k >= V keeps all
        (np.log([0.5, 0.3, 0.15, 0.05]).tolist(), 1.0, None, 0.75),  # 0.5 + 0.3 reaches 0.75
        (np.log([0.5, 0.3, 0.15, 0.05]).tolist(), 1.0, None, 0.85),  # needs three
        (np.log([0.5, 0.3, 0.15, 0.05]).tolist(), 1.0, None, 0.4),  # the top one alone
        (np.log([0.05, 0.3, 0.15, 0.5]).tolist(), 1.0, None, 0.9),  # order of ids irrelevant
        (np.log([0.4, 0.3, 0.2, 0.1]).tolist(), 1.0, 3, 0.7),  # top-k, then top-p of the rest
        ([1.0, 1.0, 1.0, 1.0], 1.0, None, 0.6),  # ties under top-p: lowest ids first
    ],
)
def test_filter_probs_match_numpy(logits, temperature, top_k, top_p) -> None:
    got = filter_probs(torch.tensor([logits]), temperature, top_k, top_p)[0]
    np.testing.assert_allclose(
        got.numpy(), numpy_filter(logits, temperature, top_k, top_p), atol=1e-6
    )


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.integers(-4, 4).map(float), min_size=1, max_size=12),
    top_k=st.none() | st.integers(1, 14),
    top_p=st.floats(0.05, 1.0),
)
def test_filter_keeps_exactly_k_and_the_smallest_nucleus(logits, top_k, top_p) -> None:
    """Integer logits make ties common: top-k keeps min(k, V) tokens; top-p keeps the most
    likely tokens until their mass reaches top_p, and not one more."""
    top_k_probs = numpy_filter(logits, 1.0, top_k)
    cum = np.cumsum(np.sort(top_k_probs)[::-1])
    assume(np.abs(cum - top_p).min() > 1e-5)  # float32 vs float64 may round a tie either way
    probs = filter_probs(torch.tensor([logits]), 1.0, top_k, top_p)[0].double()
    kept = probs > 0
    if top_p == 1.0 and top_k is not None:
        assert int(kept.sum()) == min(top_k, len(logits))
    np.testing.assert_allclose(probs.numpy(), numpy_filter(logits, 1.0, top_k, top_p), atol=1e-6)
    assert abs(float(probs.sum()) - 1.0) < 1e-6


def test_top_k_keeps_exactly_k_tokens_on_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 2.0]]).expand(4000, 6)  # (4000, 6)
    ids = sample_next(logits, torch.Generator().manual_seed(0), 1.0, top_k=2)
    assert set(ids.tolist()) == {1, 2}  # nanoGPT's `logits < v[..., -1]` would also keep 3
    ids = sample_next(logits, torch.Generator().manual_seed(0), 1.0, top_k=1)
    assert set(ids.tolist()) == {1}


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, 1.0), (0.5, 4, 1.0), (1.3, None, 0.8), (0.9, 5, 0.9)],
)
def test_sample_frequencies_follow_filtered_distribution(temperature, top_k, top_p) -> None:
    logits = torch.tensor([[0.3, -0.2, 1.5, 0.9, 0.0, 1.1, -1.0, 0.4]])  # (1, 8)
    n = 40_000
    ids = sample_next(
        logits.expand(n, 8), torch.Generator().manual_seed(1), temperature, top_k, top_p
    )
    freq = np.bincount(ids.numpy(), minlength=8) / n
    expected = numpy_filter(logits[0].tolist(), temperature, top_k, top_p)
    np.testing.assert_allclose(freq, expected, atol=0.012)  # ~5 standard deviations
    assert (freq[expected == 0] == 0).all()


def test_inverse_cdf_never_picks_a_zero_probability_token() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 3)  # (3, 5)
    u = torch.tensor([0.0, 0.5, 1.0 - 2**-53], dtype=torch.float64)
    assert _inverse_cdf(probs, u).tolist() == [1, 3, 3]


def test_temperature_zero_is_greedy_and_ignores_the_generator() -> None:
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(123)
    state = g.get_state()
    for top_k, top_p in [(None, 1.0), (3, 0.5)]:
        assert torch.equal(sample_next(logits, g, 0.0, top_k, top_p), logits.argmax(-1))
    assert torch.equal(g.get_state(), state)  # no random number drawn
    model = make_model()
    runs = [generate_ids(model, [[1, 2, 3]], 12, temperature=0.0, seed=s) for s in (0, 1, 99)]
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][0] == reference_generate(model, [1, 2, 3], 12, temperature=0.0)


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    model = make_model()
    kw = dict(temperature=1.0, top_k=20)
    a = generate_ids(model, [[5, 6]], 20, seed=7, **kw)
    assert a == generate_ids(model, [[5, 6]], 20, seed=7, **kw)
    assert a != generate_ids(model, [[5, 6]], 20, seed=8, **kw)


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
        check_sampling(**args)
    with pytest.raises(InputError, match=name):
        next(generate(make_model(), [[1]], 3, **args))


# ----------------------------------------------------------------------------- KV cache


SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=3),
    dict(temperature=0.8, top_k=10, top_p=0.9, seed=11),
]


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("settings", SETTINGS, ids=["greedy", "sampled", "top-k-p"])
def test_cached_equals_full_recompute_also_past_the_context(pos_emb, settings) -> None:
    model = make_model(pos_emb)
    # prompt 3 + 20 new tokens crosses context_length (8); 11 tokens start beyond it.
    for prompt in ([4, 9, 1], list(range(1, 12))):
        cached = generate_ids(model, [prompt], 20, use_cache=True, **settings)[0]
        uncached = generate_ids(model, [prompt], 20, use_cache=False, **settings)[0]
        reference = reference_generate(model, prompt, 20, **settings)
        assert cached == uncached == reference


def test_cache_feeds_one_token_per_step_until_the_window_slides() -> None:
    model = make_model()
    lengths = []
    forward = model.forward

    def spy(idx, *args, **kwargs):
        lengths.append((idx.shape[1], kwargs.get("kv_cache") is not None))
        return forward(idx, *args, **kwargs)

    model.forward = spy
    generate_ids(model, [[1, 2, 3]], 10, temperature=0.0)
    # prefill 3, five single tokens (sequence reaches 8 = context), then the sliding window.
    assert lengths == [(3, True)] + [(1, True)] * 5 + [(8, False)] * 4


# ----------------------------------------------------------------------------- batches


PROMPTS = [[3], [1, 2, 3, 4, 5], list(range(1, 13)), [7, 7, 2]]  # 12 > context_length


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("settings", SETTINGS, ids=["greedy", "sampled", "top-k-p"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_padded_batch_equals_each_prompt_alone(pos_emb, settings, use_cache) -> None:
    model = make_model(pos_emb)
    seed = settings.get("seed", 0)
    # 20 new tokens: the window slides, and the buffer (8 + 2 * 8 columns) is compacted.
    batch = generate_ids(model, PROMPTS, 20, use_cache=use_cache, **settings)
    for i, prompt in enumerate(PROMPTS):
        alone = generate_ids(model, [prompt], 20, **{**settings, "seed": seed + i})[0]
        assert batch[i] == alone, f"prompt {i}"


def test_generate_streams_one_column_per_step() -> None:
    model = make_model()
    steps = list(generate(model, PROMPTS, 5, temperature=1.0, seed=0))
    assert len(steps) == 5 and all(s.shape == (len(PROMPTS),) for s in steps)
    assert torch.stack(steps, 1).tolist() == generate_ids(
        model, PROMPTS, 5, temperature=1.0, seed=0
    )


def test_bad_prompts_raise_input_error() -> None:
    model = make_model()
    with pytest.raises(InputError, match="no tokens"):
        generate_ids(model, [[1], []], 2)
    with pytest.raises(InputError, match="outside the model's vocabulary"):
        generate_ids(model, [[1, 40]], 2)


# ----------------------------------------------------------------------------- text


CHARS = CharTokenizer("abcdefghijklmnopqrstuvwxyz \n:.")


def push_all(state: _TextState, tok, text: str) -> list[str]:
    pieces = []
    for i in tok.encode(text):
        pieces.append(state.push(i))
        if state.done:
            break
    if not state.done:
        pieces.append(state.finish())
    return pieces


@pytest.mark.parametrize(
    ("text", "stops", "completion"),
    [
        ("hello world", ["wor"], "hello "),
        ("hello world", ["wx"], "hello world"),  # 'w' held back, then released
        ("hello world", ["o w", "ll"], "he"),  # the earliest of several
        ("hello world", ["xyz"], "hello world"),
        ("a:b:c", [":c"], "a:b"),
        ("aaab", ["aab"], "a"),  # overlapping partial matches
    ],
)
def test_stop_strings_end_the_text_and_are_held_back(text, stops, completion) -> None:
    state = _TextState(CHARS, stops, set())
    pieces = push_all(state, CHARS, text)
    assert "".join(pieces) == state.text == completion
    assert state.stop_reason == ("stop" if completion != text else "length")


def test_streaming_holds_back_only_what_could_start_a_stop() -> None:
    state = _TextState(CHARS, ["wx", "lo!"], set())
    pieces = [state.push(i) for i in CHARS.encode("hello w")]
    assert pieces == ["h", "e", "", "l", "", "lo ", ""]  # "l", "lo", "w" wait for more
    assert state.push(CHARS.encode("o")[0]) == "wo"
    assert state.finish() == "" and state.text == "hello wo"


def test_unescape_command_line_stops() -> None:
    assert unescape(r"\n\nROMEO") == "\n\nROMEO"
    assert unescape(r"a\tb\\n\x") == "a\tb\\n\\x"  # r"\\" is one backslash, r"\x" stays
    assert unescape("é…") == "é…"


def test_multibyte_characters_split_over_byte_tokens_stream_whole() -> None:
    tok = BPETokenizer.train(["plain ascii text"], vocab_size=257)  # bytes only, no merges
    text = "héllo wörld ✓ 😀"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    state = _TextState(tok, [], set())
    pieces = [state.push(i) for i in ids] + [state.finish()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_decoding_keeps_spaces_that_sentencepiece_drops_at_a_text_start() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    hf = Tokenizer(
        models.WordLevel(
            {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁ROMEO:": 3, "!": 4}, unk_token="<unk>"
        )
    )
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    tok = BPETokenizer(hf)
    assert tok.decode([1]) == "hello" and tok.decode([3, 1]) == "ROMEO: hello"
    for prompt, expected in (([3], " hello world! hello"), ([], "hello world! hello")):
        state = _TextState(tok, [], set(), prompt)
        assert "".join(state.push(i) for i in [1, 2, 4, 1]) == expected
        assert tok.decode(prompt + [1, 2, 4, 1]) == tok.decode(prompt) + expected


def test_stop_id_ends_the_sample_without_text() -> None:
    state = _TextState(CHARS, [], {CHARS.encode(".")[0]})
    assert "".join(push_all(state, CHARS, "abc.def")) == "abc" == state.text
    assert state.stop_reason == "stop" and len(state.ids) == 4


def test_ordered_writer_writes_interleaved_samples_in_order() -> None:
    out: list[str] = []
    w = OrderedWriter(out.append, ["P0:", "P1:", "P2:"], separator="--")
    w.text(1, "b1")
    w.text(0, "a1")
    w.text(2, "c1\n")
    w.end(2)
    w.end(1)
    assert "".join(out) == "P0:a1"
    w.text(0, "a2")
    w.end(0)
    assert "".join(out) == "P0:a1a2\n--\nP1:b1\n--\nP2:c1\n"


def test_sample_texts_batch_equals_alone_and_streams_the_same_text() -> None:
    model = make_model(vocab=CHARS.vocab_size)
    prompts = ["ab", "hello there", ""]
    out: list[str] = []
    samples = sample_texts(
        model,
        CHARS,
        prompts,
        max_new_tokens=15,
        temperature=1.0,
        top_k=12,
        seed=5,
        num_samples=2,
        stop=["q"],
        sink=OrderedWriter(out.append, [p for p in prompts for _ in range(2)]),
    )
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (i, j) for i in range(3) for j in range(2)
    ]
    assert "".join(out) == format_samples(samples)
    for r, s in enumerate(samples):
        alone = sample_texts(
            model,
            CHARS,
            [s.prompt],
            max_new_tokens=15,
            temperature=1.0,
            top_k=12,
            seed=5 + r,
            stop=["q"],
        )[0]
        assert (alone.completion, alone.tokens, alone.seed) == (s.completion, s.tokens, 5 + r)
        start = CHARS.encode(s.prompt or "\n")
        ids = generate_ids(model, [start], 15, temperature=1.0, top_k=12, seed=5 + r)[0]
        full = CHARS.decode(ids)
        if "q" in full:
            assert s.completion == full[: full.index("q")] and s.stop_reason == "stop"
        else:
            assert s.completion == full and s.tokens == 15 and s.stop_reason == "length"
    d = samples[0].to_dict()
    assert {"prompt", "completion", "tokens", "tokens_per_s"} <= set(d)
    json.dumps(d)


def test_long_prompt_is_cropped_with_one_warning(caplog) -> None:
    model = make_model(vocab=CHARS.vocab_size)
    with caplog.at_level(logging.WARNING, logger="llmcli.generate"):
        s = sample_texts(
            model, CHARS, ["abcdefghijklmnop", "xyzxyzxyzxyz"], max_new_tokens=4, temperature=0.0
        )
    assert len([r for r in caplog.records if "context_length" in r.getMessage()]) == 1
    ids = generate_ids(model, [CHARS.encode("ijklmnop")], 4, temperature=0.0)[0]
    assert s[0].completion == CHARS.decode(ids)


# ----------------------------------------------------------------------------- prompt files


def test_read_prompts(tmp_path) -> None:
    lines = tmp_path / "p.txt"
    lines.write_text("ROMEO:\n\n[Enter JULIET]\nJULIET: hi\n")
    assert read_prompts(None, lines) == ["ROMEO:", "[Enter JULIET]", "JULIET: hi"]
    js = tmp_path / "p.json"
    js.write_text(json.dumps(["a\nb", "", "c"]))
    assert read_prompts(None, js) == ["a\nb", "", "c"]
    listy = tmp_path / "list.txt"
    listy.write_text('["x", "y"]')
    assert read_prompts(None, listy) == ["x", "y"]
    assert read_prompts("-", None, io.StringIO("from stdin\n")) == ["from stdin\n"]
    assert read_prompts(None, "-", io.StringIO("a\nb\n")) == ["a", "b"]
    assert read_prompts(None, None) == [""]
    assert read_prompts("ROMEO:", None) == ["ROMEO:"]


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        (None, "missing.txt", "does not exist"),
        (b"\n\n", "empty.txt", "holds no prompts"),
        (b'{"a": 1}', "p.json", "JSON list of strings"),
        (b"[1, 2", "p.json", "not valid JSON"),
        (b"\xff\xfe\x00bad", "bin.txt", "not UTF-8"),
    ],
)
def test_bad_prompt_files(tmp_path, content, name, message) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InputError, match=message):
        read_prompts(None, path)
    with pytest.raises(InputError, match="not both"):
        read_prompts("x", path)
