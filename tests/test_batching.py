"""Prompts in, samples out, in batches (llmcli/generation/batching.py): batched `sample_texts`
against samples alone and against the engine's ids, the same text streamed, one prefill per
prompt for its samples, long prompts cropped with one notice, the settings checked once, the
options' checks."""

from __future__ import annotations

import json
import logging

import pytest
from test_engine import make_model

from llmcli.config import SampleConfig
from llmcli.data.tokenizer import CharTokenizer
from llmcli.errors import InputError
from llmcli.generation.batching import SampleOptions, sample_texts
from llmcli.generation.engine import generate_ids
from llmcli.generation.sample import format_samples
from llmcli.generation.streaming import OrderedWriter

pytestmark = pytest.mark.usefixtures("one_thread")

CHARS = CharTokenizer("abcdefghijklmnopqrstuvwxyz \n:.")


def test_sample_texts_batch_equals_alone_and_streams_the_same_text() -> None:
    model = make_model(vocab=CHARS.vocab_size)
    prompts = ["ab", "hello there", ""]
    out: list[str] = []
    samples = sample_texts(
        model,
        CHARS,
        prompts,
        SampleConfig(max_new_tokens=15, temperature=1.0, top_k=12, seed=5),
        SampleOptions(num_samples=2, stop=("q",)),
        sink=OrderedWriter(out.append, [p for p in prompts for _ in range(2)]),
    )
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (i, j) for i in range(3) for j in range(2)
    ]
    assert "".join(out) == format_samples(samples)
    for r, s in enumerate(samples):
        config = SampleConfig(max_new_tokens=15, temperature=1.0, top_k=12, seed=5 + r)
        [alone] = sample_texts(model, CHARS, [s.prompt], config, SampleOptions(stop=("q",)))
        assert (alone.completion, alone.tokens, alone.seed) == (s.completion, s.tokens, 5 + r)
        start = CHARS.encode(s.prompt or "\n")
        [ids] = generate_ids(model, [start], config)
        full = CHARS.decode(ids)
        if "q" in full:
            assert s.completion == full[: full.index("q")] and s.stop_reason == "stop"
        else:
            assert s.completion == full and s.tokens == 15 and s.stop_reason == "length"
    d = samples[0].to_dict()
    assert {"prompt", "completion", "tokens", "tokens_per_s"} <= set(d)
    json.dumps(d)


def test_the_samples_of_a_prompt_share_its_prefill() -> None:
    """`--num-samples 4` of two prompts: the prefill runs the two prompts, not the 8 rows, and
    each sample is still the text it is alone with its seed."""
    model = make_model(vocab=CHARS.vocab_size)
    shapes: list[tuple[int, int]] = []
    forward = model.forward

    def spy(idx, *args, **kwargs):
        shapes.append(tuple(idx.shape))
        return forward(idx, *args, **kwargs)

    model.forward = spy
    config = SampleConfig(max_new_tokens=6, temperature=1.0, top_k=12, seed=3)
    samples = sample_texts(model, CHARS, ["ab", "hello"], config, SampleOptions(num_samples=4))
    assert shapes[0] == (2, 5)  # "ab" left-padded to "hello"'s 5 columns
    assert len({s.completion for s in samples[:4]}) > 1  # samples, not copies
    for r, s in enumerate(samples):
        alone = SampleConfig(max_new_tokens=6, temperature=1.0, top_k=12, seed=3 + r)
        assert sample_texts(model, CHARS, [s.prompt], alone)[0].completion == s.completion


def test_long_prompt_is_cropped_with_one_warning(caplog) -> None:
    model = make_model(vocab=CHARS.vocab_size)
    with caplog.at_level(logging.WARNING, logger="llmcli.generation.batching"):
        greedy = SampleConfig(max_new_tokens=4, temperature=0.0)
        s = sample_texts(model, CHARS, ["abcdefghijklmnop", "xyzxyzxyzxyz"], greedy)
    assert len([r for r in caplog.records if "context_length" in r.getMessage()]) == 1
    [ids] = generate_ids(model, [CHARS.encode("ijklmnop")], greedy)
    assert s[0].completion == CHARS.decode(ids)


def count_checks(monkeypatch) -> list[tuple]:
    """Record (temperature, top_k, top_p) of every `SampleConfig` checked (as it is made)."""
    calls: list[tuple] = []
    validate = SampleConfig.validate

    def spy(self):
        calls.append((self.temperature, self.top_k, self.top_p))
        return validate(self)

    monkeypatch.setattr(SampleConfig, "validate", spy)
    return calls


def test_sample_texts_checks_the_settings_once(monkeypatch) -> None:
    calls = count_checks(monkeypatch)
    model = make_model(vocab=CHARS.vocab_size)
    config = SampleConfig(max_new_tokens=3, temperature=0.5, top_k=4)
    sample_texts(model, CHARS, ["ab", "cd"], config, SampleOptions(batch_size=1))
    assert calls == [(0.5, 4, 1.0)]  # when it was made, not again for each batch
    with pytest.raises(InputError, match="top_p"):
        sample_texts(model, CHARS, ["ab"], SampleConfig(max_new_tokens=3, top_p=0.0))


def test_sample_options_refuse_a_batch_of_no_samples() -> None:
    for bad in (0, -2, True):
        with pytest.raises(InputError, match=rf"batch_size \({bad}\) must be an integer >= 1"):
            SampleOptions(batch_size=bad)


def test_compile_is_chosen_once_for_every_batch(monkeypatch, caplog) -> None:
    """`--compile` where it does not pay for the largest batch (more rows than it measured
    faster for): said once, and no batch, the smaller last one included, compiles."""
    from llmcli.generation import compiled_decode

    asked: list[int] = []

    def no_compile(cls, model, rows, **kwargs):
        asked.append(rows)
        raise AssertionError("compiled where it does not pay")

    monkeypatch.setattr(compiled_decode.CompiledDecoder, "for_model", classmethod(no_compile))
    model = make_model(vocab=CHARS.vocab_size).eval()
    rows = compiled_decode.PAYS_ROWS + 1
    options = SampleOptions(num_samples=2 * rows + 2, batch_size=rows, compile=True)
    config = SampleConfig(max_new_tokens=3, temperature=1.0, seed=5)
    with caplog.at_level(logging.WARNING):
        samples = sample_texts(model, CHARS, ["ab"], config, options)
    plain = sample_texts(model, CHARS, ["ab"], config, SampleOptions(num_samples=2 * rows + 2))
    assert [s.completion for s in samples] == [s.completion for s in plain]
    notes = [r.getMessage() for r in caplog.records if "no faster" in r.getMessage()]
    assert len(notes) == 1 and asked == []
