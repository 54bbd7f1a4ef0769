"""Prompt files and prompt encoding (llmcli/generation/prompts.py), in both modes: sampling's (an
empty prompt starts from the start ids, a long one is cropped, a file starting with `[` may be
lines) and strict (empty or long prompts refused, such a file must be JSON, blank lines skipped);
the messages for prompts longer than the context, word for word; `llmcli sample`'s prompt options
(`read_prompts`) and the escapes typed on a command line (`unescape`)."""

from __future__ import annotations

import io
import json

import pytest

from llmcli.data.tokenizer import BPETokenizer, CharTokenizer
from llmcli.errors import InputError
from llmcli.generation.prompts import (
    crop_chat_prompt,
    encode_prompt,
    encode_prompts,
    parse_prompts,
    read_prompt_file,
    read_prompts,
    too_long_message,
    unescape,
)

CHARS = CharTokenizer("abcdefghijklmnopqrstuvwxyz \n:.")
STRICT = dict(strict_json=True, skip_blank=True)


# ----------------------------------------------------------------------------- prompt files


def test_lines_skip_empty_lines_and_blank_ones_when_asked(tmp_path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("first\n\n  \nsecond line\r\nthird\r\n")
    assert read_prompt_file(path) == ["first", "  ", "second line", "third"]
    assert read_prompt_file(path, skip_blank=True) == ["first", "second line", "third"]


def test_json_list_of_strings(tmp_path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(["a\nb", "", "c"]))
    assert read_prompt_file(path) == ["a\nb", "", "c"]
    assert read_prompt_file(path, **STRICT) == ["a\nb", "", "c"]
    listy = tmp_path / "list.txt"
    listy.write_text('  ["x", "y"]')
    assert read_prompt_file(listy) == ["x", "y"] == read_prompt_file(listy, **STRICT)


def test_a_bracket_line_is_a_prompt_unless_json_is_strict(tmp_path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("[Enter ROMEO]\nROMEO: hi\n")
    assert read_prompt_file(path) == ["[Enter ROMEO]", "ROMEO: hi"]
    with pytest.raises(InputError, match=r"p\.txt' is not valid JSON.*one prompt per line"):
        read_prompt_file(path, **STRICT)
    path.write_text('["x", 1]')
    assert read_prompt_file(path) == ['["x", 1]']
    with pytest.raises(InputError, match="must hold a JSON list of strings"):
        read_prompt_file(path, **STRICT)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        (None, "missing.txt", "does not exist"),
        ("folder", "dir.txt", "is a directory"),
        (b"\xff\xfe\x00bad", "bin.txt", "not UTF-8"),
        (b"\n\n", "empty.txt", "holds no prompts"),
        (b"[]", "empty.json", "holds no prompts"),
        (b'{"a": 1}', "p.json", "JSON list of strings"),
        (b"[1, 2", "p.json", "not valid JSON"),
    ],
)
def test_bad_prompt_files(tmp_path, strict, content, name, message) -> None:
    path = tmp_path / name
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(InputError, match=message):
        read_prompt_file(path, strict_json=strict, skip_blank=strict)


def test_messages_name_the_file_as_told(tmp_path) -> None:
    missing = tmp_path / "missing.txt"
    with pytest.raises(InputError, match=r"^prompt file '.*missing\.txt' does not exist: give a"):
        read_prompt_file(missing)
    with pytest.raises(InputError, match=r"^--prompt-file '.*' does not exist: check the path\."):
        read_prompt_file(missing, what="--prompt-file", hint="check the path")
    (tmp_path / "e.txt").write_text(" \n")
    with pytest.raises(InputError, match=r"^--prompt-file '.*e\.txt' holds no prompts"):
        read_prompt_file(tmp_path / "e.txt", what="--prompt-file", skip_blank=True)


def test_parse_prompts_of_text_from_stdin() -> None:
    assert parse_prompts("a\nb\n", "-") == ["a", "b"]
    assert parse_prompts('["a\\nb"]', "-") == ["a\nb"]
    with pytest.raises(InputError, match="prompt file '-' holds no prompts"):
        parse_prompts("", "-")


# ----------------------------------------------------------------------------- encoding


class Silent(CharTokenizer):
    """Encodes "~" to no token at all (as a BPE may drop characters)."""

    def encode(self, text: str) -> list[int]:
        return super().encode(text.replace("~", ""))


SILENT = Silent(CHARS.chars)


def test_sampling_mode_starts_empty_prompts_and_crops_long_ones() -> None:
    newline = CHARS.encode("\n")
    assert encode_prompt(CHARS, "", 8) == (newline, False)
    assert encode_prompt(SILENT, "~~", 8) == (newline, False)
    assert encode_prompt(CHARS, "abc", 8) == (CHARS.encode("abc"), False)
    assert encode_prompt(CHARS, "abcdefgh", 8) == (CHARS.encode("abcdefgh"), False)
    assert encode_prompt(CHARS, "abcdefghij", 8) == (CHARS.encode("cdefghij"), True)
    bpe = BPETokenizer.train(["plain ascii text"], vocab_size=257)
    assert encode_prompt(bpe, "", 8) == ([bpe.eot_id], False)


def test_strict_mode_refuses_empty_and_long_prompts() -> None:
    strict = dict(empty="error", too_long="error")
    assert encode_prompt(CHARS, "abcdefgh", 8, **strict) == (CHARS.encode("abcdefgh"), False)
    with pytest.raises(InputError, match="^the prompt is empty: give at least one character"):
        encode_prompt(CHARS, "", 8, **strict)
    with pytest.raises(InputError, match="^prompt #2 is empty"):
        encode_prompt(CHARS, "", 8, **strict, label="prompt #2")
    with pytest.raises(InputError, match="^the prompt encodes to no tokens"):
        encode_prompt(SILENT, "~", 8, **strict, label="")
    with pytest.raises(
        InputError,
        match=r"^the prompt is 10 tokens long but the model's context_length is 8: "
        r"shorten it, or pass --truncate to keep its last 8 tokens\.$",
    ):
        encode_prompt(CHARS, "abcdefghij", 8, **strict)
    # --truncate: refuse an empty prompt, crop a long one.
    truncate = dict(empty="error", too_long="crop")
    assert encode_prompt(CHARS, "abcdefghij", 8, **truncate) == (CHARS.encode("cdefghij"), True)
    with pytest.raises(InputError, match="empty"):
        encode_prompt(CHARS, "", 8, **truncate)


def test_text_outside_the_vocabulary_and_unknown_choices_raise() -> None:
    with pytest.raises(InputError, match="vocabulary lacks"):
        encode_prompt(CHARS, "Zebra", 8)
    with pytest.raises(ValueError, match="unknown choice"):
        encode_prompt(CHARS, "a", 8, too_long="cut")  # type: ignore[arg-type]


def test_lone_surrogates_are_refused_as_not_text() -> None:
    # JSON's "\ud800", or a byte that is not UTF-8 in a command-line argument (surrogateescape).
    bpe = BPETokenizer.train(["plain text"], vocab_size=257)
    for tokenizer in (CHARS, bpe):
        for prompt, shown in [("ab\ud800", r"'\\ud800' at character 2"), ("\udcff", r"'\\udcff'")]:
            with pytest.raises(
                InputError, match=rf"^prompt 1 holds {shown}.*not UTF-8.*UTF-8 text"
            ):
                encode_prompt(tokenizer, prompt, 8, label="prompt 1")
    # A character past the BMP (a surrogate pair in JSON) is text.
    assert encode_prompt(bpe, "a\U0001f600", 8)[0] == bpe.encode("a\U0001f600")


# ----------------------------------------------------------------------- longer than the context


def test_sampling_notices_one_line_for_the_prompts_cropped() -> None:
    notices: list[str] = []
    assert encode_prompts(CHARS, ["abc", ""], 8, notices.append) == [
        CHARS.encode("abc"),
        CHARS.encode("\n"),
    ]
    assert notices == []
    assert encode_prompts(CHARS, ["abcdefghij"], 8, notices.append) == [CHARS.encode("cdefghij")]
    assert notices == [
        "the prompt is longer than the model's context_length (8 tokens): the model sees only "
        "its last 8 tokens."
    ]
    notices.clear()
    prompts = ["a", *["abcdefghij"] * 6, "b"]
    encode_prompts(CHARS, prompts, 8, notices.append)
    assert notices == [
        "6 prompts (indices 1, 2, 3, 4, 5, ...) are longer than the model's context_length (8 "
        "tokens): the model sees only the last 8 tokens of each."
    ]
    notices.clear()  # one of several: named alone, in the singular
    encode_prompts(CHARS, ["a", "abcdefghij", "b"], 8, notices.append)
    assert notices == [
        "prompt 1 is longer than the model's context_length (8 tokens): the model sees only its "
        "last 8 tokens."
    ]
    notices.clear()
    with pytest.raises(InputError, match="vocabulary lacks"):  # before any notice
        encode_prompts(CHARS, ["abcdefghij", "Zebra"], 8, notices.append)
    assert notices == []


def test_a_chat_prompt_is_cropped_with_a_notice() -> None:
    notices: list[str] = []
    assert crop_chat_prompt([1, 2, 3], 3, notices.append) == [1, 2, 3] and notices == []
    assert crop_chat_prompt([1, 2, 3, 4, 5], 3, notices.append) == [3, 4, 5]
    assert notices == [
        "the message is longer than the context (5 > 3 tokens): the model sees only the last 3 "
        "tokens of the prompt."
    ]


def test_the_refusals_name_the_lengths_and_what_to_do() -> None:
    assert too_long_message("--prompt", 17, 16, "shorten it to at most 16 tokens.") == (
        "--prompt is 17 tokens long but the model's context_length is 16: shorten it to at most "
        "16 tokens."
    )
    assert too_long_message("prompt 1", 40, 32, "shorten it.", served=True) == (
        "prompt 1 is 40 tokens long but this model's context_length is 32 tokens: shorten it."
    )
    with pytest.raises(
        InputError,
        match=r"^--clean is 10 tokens long but the model's context_length is 8: shorten it to "
        r"at most 8 tokens\.$",
    ):
        fix = "shorten it to at most 8 tokens."
        encode_prompt(CHARS, "abcdefghij", 8, too_long="error", label="--clean", fix=fix)


# ----------------------------------------------------------------------------- the command line


def test_unescape_command_line_stops() -> None:
    assert unescape(r"\n\nROMEO") == "\n\nROMEO"
    assert unescape(r"a\tb\\n\x") == "a\tb\\n\\x"  # r"\\" is one backslash, r"\x" stays
    assert unescape("é…") == "é…"


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
def test_bad_prompt_options(tmp_path, content, name, message) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InputError, match=message):
        read_prompts(None, path)
    with pytest.raises(InputError, match="not both"):
        read_prompts("x", path)
