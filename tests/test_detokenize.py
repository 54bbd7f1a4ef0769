"""Detokenizing as tokens come (llmcli/generation/detokenize.py): stop strings end the text and
are held back while they may still begin, multi-byte characters split over byte tokens stream
whole, decoding keeps the spaces a decoder drops at a text's start, stop ids."""

from __future__ import annotations

import pytest

from llmcli.data.tokenizer import BPETokenizer, CharTokenizer
from llmcli.generation.detokenize import TextState

CHARS = CharTokenizer("abcdefghijklmnopqrstuvwxyz \n:.")


def push_all(state: TextState, tok, text: str) -> list[str]:
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
    state = TextState(CHARS, stops, set())
    pieces = push_all(state, CHARS, text)
    assert "".join(pieces) == state.text == completion
    assert state.stop_reason == ("stop" if completion != text else "length")


def test_streaming_holds_back_only_what_could_start_a_stop() -> None:
    state = TextState(CHARS, ["wx", "lo!"], set())
    pieces = [state.push(i) for i in CHARS.encode("hello w")]
    assert pieces == ["h", "e", "", "l", "", "lo ", ""]  # "l", "lo", "w" wait for more
    assert state.push(CHARS.encode("o")[0]) == "wo"
    assert state.finish() == "" and state.text == "hello wo"


def test_multibyte_characters_split_over_byte_tokens_stream_whole() -> None:
    tok = BPETokenizer.train(["plain ascii text"], vocab_size=257)  # bytes only, no merges
    text = "héllo wörld ✓ 😀"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    state = TextState(tok, [], set())
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
        state = TextState(tok, [], set(), prompt)
        assert "".join(state.push(i) for i in [1, 2, 4, 1]) == expected
        assert tok.decode(prompt + [1, 2, 4, 1]) == tok.decode(prompt) + expected


def test_stop_id_ends_the_sample_without_text() -> None:
    state = TextState(CHARS, [], {CHARS.encode(".")[0]})
    assert "".join(push_all(state, CHARS, "abc.def")) == "abc" == state.text
    assert state.stop_reason == "stop" and len(state.ids) == 4
