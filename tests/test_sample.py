"""Text around generation (llmcli/generation/sample.py): stop strings, streaming decode and order,
batched `sample_texts` against samples alone, long prompts, prompt files."""

from __future__ import annotations

import io
import json
import logging

import pytest
from conftest import save_tiny_run
from test_engine import make_model

from llmcli.config import SampleConfig
from llmcli.data.tokenizer import BPETokenizer, CharTokenizer
from llmcli.errors import ConfigError, InputError
from llmcli.generation.engine import generate_ids
from llmcli.generation.sample import (
    OrderedWriter,
    SampleOptions,
    _TextState,
    format_samples,
    read_prompts,
    sample_run,
    sample_texts,
    unescape,
)

pytestmark = pytest.mark.usefixtures("one_thread")


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


def test_long_prompt_is_cropped_with_one_warning(caplog) -> None:
    model = make_model(vocab=CHARS.vocab_size)
    with caplog.at_level(logging.WARNING, logger="llmcli.generation.sample"):
        greedy = SampleConfig(max_new_tokens=4, temperature=0.0)
        s = sample_texts(model, CHARS, ["abcdefghijklmnop", "xyzxyzxyzxyz"], greedy)
    assert len([r for r in caplog.records if "context_length" in r.getMessage()]) == 1
    [ids] = generate_ids(model, [CHARS.encode("ijklmnop")], greedy)
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


# ----------------------------------------------------------------------------- validation


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
