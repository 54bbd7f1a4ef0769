"""Prompts: reading them (a file, the command line), and turning them into token ids that fit a
model, with the messages for prompts that do not.

A prompt file holds one prompt per line, or a JSON list of strings (the form for prompts that
contain newlines); `read_prompts` takes `llmcli sample`'s options, `unescape` the escapes typed
on a command line. `encode_prompt` either repairs a prompt that does not fit (an empty one starts
from the tokenizer's start ids, a long one keeps its last `context_length` tokens), which is
what sampling wants, or refuses it, for commands whose output must cover exactly the text given.
Every message about a prompt longer than the context is worded here: `encode_prompts` (sampling:
cropped, with one notice), `crop_chat_prompt` (a chat turn, cropped with a notice) and
`too_long_message` (a refusal: `encode_prompt`'s, the inspection commands' in
`llmcli.inspection.answers`, the server's). `check_prompt_ids` checks prompts given as token ids.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Literal

from llmcli.data.tokenizer import Tokenizer, start_ids
from llmcli.errors import InputError
from llmcli.fileio import read_user_text

_EXAMPLE = '["ROMEO:", "JULIET:"]'
# A lone UTF-16 surrogate is no text, yet a Python string can hold one: JSON's "\ud800", or a
# byte that is not UTF-8 in a command-line argument (which Python decodes with surrogateescape).
_SURROGATE = re.compile("[\ud800-\udfff]")


def read_prompt_file(
    path: str | Path,
    *,
    what: str = "prompt file",
    hint: str = "give a text or JSON file",
    strict_json: bool = False,
    skip_blank: bool = False,
) -> list[str]:
    """The prompts of a UTF-8 file (see `parse_prompts`).

    Args:
        path: the file.
        what: how messages name it, e.g. "prompt file" or "--prompt-file".
        hint: what to do when the file does not exist.
        strict_json, skip_blank: see `parse_prompts`.

    Raises:
        InputError: the file does not exist, is a folder, cannot be read or is not UTF-8, or it
            holds no prompts or malformed JSON (see `parse_prompts`).
    """
    text = read_user_text(path, what, hint=hint)
    return parse_prompts(
        text, str(Path(path)), what=what, strict_json=strict_json, skip_blank=skip_blank
    )


def parse_prompts(
    text: str,
    name: str,
    *,
    what: str = "prompt file",
    strict_json: bool = False,
    skip_blank: bool = False,
) -> list[str]:
    """The prompts in the text of a prompt file: a JSON list of strings, or one per line.

    A file whose name ends in `.json` must be a JSON list of strings. Another file is read as
    JSON when its text starts with `[`: with `strict_json` it must then be a list of strings;
    without, a text that is not one is read as lines (a first line may start with `[`).
    In the line form the newline ending a line is not part of its prompt and empty lines are
    skipped; `skip_blank` also skips lines of only whitespace.

    Args:
        text: the file's content.
        name: the file's name, for messages and its `.json` ending ("-" for stdin).
        what: how messages name the file.

    Raises:
        InputError: no prompts at all, or malformed JSON where JSON is required.
    """
    is_json = name.endswith(".json")
    prompts: list[str] | None = None
    if is_json or text.lstrip().startswith("["):
        prompts = _json_prompts(text, name, what, required=is_json or strict_json)
    if prompts is None:
        lines = text.splitlines()  # drops every line ending, "\r" included
        if skip_blank:
            prompts = [line for line in lines if line.strip()]
        else:
            prompts = [line for line in lines if line]
    if not prompts:
        raise InputError(
            f"{what} {name!r} holds no prompts: write one prompt per line, or a JSON list of "
            f"strings such as {_EXAMPLE}."
        )
    return prompts


def _json_prompts(text: str, name: str, what: str, required: bool) -> list[str] | None:
    """The list of strings `text` holds as JSON; None if it holds none and is not `required`."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        if not required:
            return None
        raise InputError(
            f"{what} {name!r} is not valid JSON ({exc}): write a JSON list of strings, or one "
            "prompt per line."
        ) from None
    if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
        if not required:
            return None
        raise InputError(f"{what} {name!r} must hold a JSON list of strings, such as {_EXAMPLE}.")
    return data


def encode_prompt(
    tokenizer: Tokenizer,
    prompt: str,
    context_length: int,
    *,
    empty: Literal["start", "error"] = "start",
    too_long: Literal["crop", "error"] = "crop",
    label: str = "the prompt",
    fix: str | None = None,
) -> tuple[list[int], bool]:
    """Token ids of `prompt`, at most `context_length` of them.

    Args:
        tokenizer: the run's tokenizer.
        prompt: the text.
        context_length: the model's context length.
        empty: for an empty prompt, or text that encodes to no tokens (e.g. only characters a
            BPE drops): "start" from the tokenizer's start ids (`llmcli.data.tokenizer.start_ids`),
            or "error".
        too_long: for a prompt of more than `context_length` tokens: "crop" it to its last
            `context_length` tokens, or "error" (see `too_long_message`).
        label: how messages name the prompt, e.g. "prompt #2" ("" = "the prompt").
        fix: what the "error" of a prompt too long tells the user to do (None: shorten it, or
            pass `--truncate`).

    Returns:
        `(ids, cropped)`: `cropped` says the prompt was longer than `context_length`.

    Raises:
        InputError: as `empty` and `too_long` say, or for text outside the vocabulary or that
            holds a lone surrogate.
    """
    if empty not in ("start", "error") or too_long not in ("crop", "error"):
        raise ValueError(f"empty={empty!r}, too_long={too_long!r}: unknown choice")
    what = label or "the prompt"
    if (bad := _SURROGATE.search(prompt)) is not None:
        raise InputError(
            f"{what} holds {bad.group()!r} at character {bad.start()}, which is not text (a byte "
            "that is not UTF-8, or half of a UTF-16 surrogate pair): give it as UTF-8 text."
        )
    if prompt == "" and empty == "error":
        raise InputError(f"{what} is empty: give at least one character of text.")
    ids = list(start_ids(tokenizer)) if prompt == "" else list(tokenizer.encode(prompt))
    if not ids:
        if empty == "error":
            raise InputError(f"{what} encodes to no tokens: give some text.")
        ids = list(start_ids(tokenizer))
    if len(ids) > context_length and too_long == "error":
        if fix is None:
            fix = f"shorten it, or pass --truncate to keep its last {context_length} tokens."
        raise InputError(too_long_message(what, len(ids), context_length, fix))
    return ids[-context_length:], len(ids) > context_length


def too_long_message(
    what: str, n_tokens: int, context_length: int, fix: str, *, served: bool = False
) -> str:
    """Why a prompt of `n_tokens` tokens is refused: `{what} is {n_tokens} tokens long but the
    model's context_length is {context_length}: {fix}` (`served`: the server's words for the
    model it serves, "this model's context_length is {context_length} tokens")."""
    if served:
        limit = f"this model's context_length is {context_length} tokens"
    else:
        limit = f"the model's context_length is {context_length}"
    return f"{what} is {n_tokens} tokens long but {limit}: {fix}"


def encode_prompts(
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    context_length: int,
    notify: Callable[[str], Any],
) -> list[list[int]]:
    """Each prompt's token ids as sampling takes them (`encode_prompt`: an empty prompt starts
    from the start ids, a long one keeps its last `context_length` tokens), with one notice on
    `notify` for the prompts cropped, if any.

    Raises:
        InputError: a prompt that cannot be encoded (see `encode_prompt`), before any notice.
    """
    encoded = [encode_prompt(tokenizer, p, context_length) for p in prompts]
    cropped = [i for i, (_, was_cropped) in enumerate(encoded) if was_cropped]
    if len(cropped) == 1 and len(prompts) == 1:
        notify(
            f"the prompt is longer than the model's context_length ({context_length} tokens): "
            f"the model sees only its last {context_length} tokens."
        )
    elif len(cropped) == 1:
        notify(
            f"prompt {cropped[0]} is longer than the model's context_length ({context_length} "
            f"tokens): the model sees only its last {context_length} tokens."
        )
    elif cropped:
        shown = ", ".join(str(i) for i in cropped[:5]) + (", ..." if len(cropped) > 5 else "")
        notify(
            f"{len(cropped)} prompts (indices {shown}) are longer than the model's "
            f"context_length ({context_length} tokens): the model sees only the last "
            f"{context_length} tokens of each."
        )
    return [ids for ids, _ in encoded]


def crop_chat_prompt(
    ids: list[int], context_length: int, notify: Callable[[str], Any]
) -> list[int]:
    """A chat prompt's ids (the conversation rendered with its template, ending with the start
    of the reply) cut to its last `context_length`, with a notice when that cuts the message."""
    if len(ids) > context_length:
        notify(
            f"the message is longer than the context ({len(ids)} > {context_length} tokens): "
            f"the model sees only the last {context_length} tokens of the prompt."
        )
    return ids[-context_length:]


def check_prompt_ids(prompts_ids: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """The prompts as lists of ints, each non-empty and inside the vocabulary.

    Raises:
        InputError: no prompt, an empty one, or ids outside `0 .. vocab_size - 1`.
    """
    if len(prompts_ids) == 0:
        raise InputError("no prompts to generate from: give at least one prompt")
    rows = []
    for i, ids in enumerate(prompts_ids):
        row = [int(t) for t in ids]
        if not row:
            raise InputError(
                f"prompt {i} has no tokens: start an empty prompt from the tokenizer's start ids "
                "(llmcli.data.tokenizer.start_ids)"
            )
        if min(row) < 0 or max(row) >= vocab_size:
            bad = sorted({t for t in row if not 0 <= t < vocab_size})
            raise InputError(
                f"prompt {i} holds token ids {bad[:10]} outside the model's vocabulary "
                f"(0..{vocab_size - 1}): was it encoded with this run's tokenizer?"
            )
        rows.append(row)
    return rows


def read_prompts(
    prompt: str | None, prompt_file: str | Path | None, stdin: IO[str] | None = None
) -> list[str]:
    """The prompts of `llmcli sample`: `--prompt TEXT`, `--prompt -` (stdin), `--prompt-file`.

    A prompt file holds one prompt per line (empty lines are skipped), or a JSON list of strings
    (a `.json` file must be one; another file is read as JSON when it parses as such a list);
    see `parse_prompts`. `--prompt-file -` reads it from stdin. With neither option there is one
    empty prompt.

    Raises:
        InputError: both options, an unreadable or empty file, a JSON file of the wrong shape.
    """
    if prompt is not None and prompt_file is not None:
        raise InputError("give either --prompt or --prompt-file, not both.")
    stdin = sys.stdin if stdin is None else stdin
    if prompt == "-":
        return [stdin.read()]
    if prompt is not None:
        return [prompt]
    if prompt_file is None:
        return [""]
    if str(prompt_file) == "-":
        return parse_prompts(stdin.read(), "-")
    return read_prompt_file(prompt_file)


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """Turn the escapes `\\n`, `\\t`, `\\r` and `\\\\` typed on a command line into the characters;
    any other backslash is kept as is (so `--stop '\\n\\n'` stops at a blank line)."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), text)
