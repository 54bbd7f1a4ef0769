"""Conversations: checked messages, read from JSONL, and turned into ids with a loss mask.

A conversation is OpenAI's and Hugging Face's shape, `[{"role": ..., "content": ...}, ...]`:
an optional `system` message first, then `user` and `assistant` turns in turn, starting with the
user, with at least one assistant turn. `encode` renders it with the run's chat template and
marks the tokens the model is trained to write, those of the spans the template says the model
writes (`ChatTemplate.render_training`: inside `{% generation %}`, the assistant's text and its
end-of-turn token; for a template without the tag, each assistant turn's text after the
generation prompt before it), as `transformers`' `return_assistant_tokens_mask` does: a token is
marked when any of its characters is. The template reads the tokenizer's special tokens
(`bos_token`, `eos_token`) as the Hugging Face export declares them
(`llmcli.data.tokenizer.special_tokens`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmcli.data.chat_template import CHAT_TOKENS, ROLES, ChatTemplate, Rendered
from llmcli.data.tokenizer import (
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    eot_text,
    special_tokens,
)
from llmcli.errors import InputError

Messages = list[dict[str, str]]


def check_messages(
    messages: Any, where: str, *, complete: bool = True, field: str = "messages"
) -> Messages:
    """`messages` as a list of `{"role", "content"}` dicts, or an `InputError` naming `where`.

    Args:
        messages: what a row (or a request) holds under "messages".
        where: where it came from, for the message ("data.jsonl line 4").
        complete: a training conversation, which needs an assistant turn; False for a prompt
            (chat, a request), which ends with the user's turn to answer.
        field: the row's key that holds them, for the message ("prompt" in a preference row).
    """
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: {field!r} must be a non-empty list of {{role, content}}.")
    checked: Messages = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
            raise InputError(
                f"{where}: message {i} must be an object with 'role' and 'content' (got "
                f"{_short(message)})."
            )
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise InputError(
                f"{where}: message {i} has the unknown role {role!r}; the roles are "
                f"{', '.join(ROLES)}."
            )
        if not isinstance(content, str):
            raise InputError(f"{where}: message {i} ({role}) needs a string 'content'.")
        special = next((t for t in CHAT_TOKENS if t in content), None)
        if special:
            raise InputError(
                f"{where}: message {i} ({role}) holds {special!r}, a token the chat template "
                "writes itself: remove it from the text."
            )
        checked.append({"role": role, "content": content})
    _check_order([m["role"] for m in checked], where, complete)
    return checked


def _check_order(roles: list[str], where: str, complete: bool) -> None:
    turns = roles[1:] if roles[0] == "system" else roles
    expected = ["user", "assistant"] * (len(turns) // 2 + 1)
    if turns != expected[: len(turns)] or not turns:
        raise InputError(
            f"{where}: the roles {roles} are out of order: a conversation is an optional system "
            "message, then user and assistant turns in turn, starting with the user."
        )
    if complete and "assistant" not in turns:
        raise InputError(f"{where}: the conversation has no assistant turn to learn from.")
    if not complete and turns[-1] != "user":
        raise InputError(f"{where}: the last message must be the user's, for a reply to it.")


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_jsonl(path: Path) -> Iterator[tuple[Messages, str]]:
    """Each row's checked messages and where it is ("file line N"), for a JSONL file whose rows
    hold `{"messages": [...]}`.

    Raises:
        InputError: a line that is not JSON or not such a row, naming the file and line.
    """
    for row, where in read_jsonl_rows(path, ("messages",), '"messages": [...]'):
        yield check_messages(row["messages"], where), where


def read_jsonl_rows(
    path: Path, keys: Sequence[str], shape: str
) -> Iterator[tuple[dict[str, Any], str]]:
    """Each non-blank line of a JSONL file as an object that has `keys`, and where it is
    ("file line N").

    Args:
        shape: what a row holds, for the message on a row that lacks a key
            ('"messages": [...]').

    Raises:
        InputError: a line that is not UTF-8, not JSON, not an object, or lacks one of `keys`,
            naming the file and line.
    """
    try:
        fh = path.open("rb")  # lines decoded one by one, so that bad bytes have a line number
    except OSError as exc:
        raise InputError(f"cannot read {str(path)!r} ({exc.strerror}).") from None
    with fh:
        offset = 0  # of the line in the file, for the byte a message names
        for line_no, raw in enumerate(fh, start=1):
            where = f"{path} line {line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(
                    f"{where} is not UTF-8 text (byte {raw[exc.start]:#04x} at offset "
                    f"{offset + exc.start} of the file): is it a binary file? JSONL is UTF-8 "
                    f"text, one row of {shape} a line (text in another encoding converts with "
                    "e.g. `iconv -f latin1 -t utf-8`)."
                ) from None
            offset += len(raw)
            if line.strip():
                yield _row(line, where, keys, shape), where


def _row(line: str, where: str, keys: Sequence[str], shape: str) -> dict[str, Any]:
    if "\x00" in line:  # valid UTF-8, but no text file holds one
        raise InputError(
            f"{where} holds NUL bytes: is it a binary file? JSONL is UTF-8 text, one row of "
            f"{shape} a line."
        )
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where} is not JSON (column {exc.colno}: {exc.msg}).") from None
    except RecursionError:  # nested deeper than Python's parser goes: no row either
        raise InputError(f"{where} is JSON nested too deeply to be a row of {shape}.") from None
    missing = [key for key in keys if not isinstance(row, dict) or key not in row]
    if missing:
        lacks = "" if not isinstance(row, dict) else f" (it has no {', '.join(map(repr, missing))})"
        raise InputError(f"{where}: a row must be an object with {shape}{lacks}.")
    return row


# --- Ids and the loss mask -----------------------------------------------------------------


def _hf(tokenizer: Tokenizer) -> Any:
    """The Hugging Face `tokenizers.Tokenizer` that encodes as `tokenizer` does."""
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.to_hf()
    if isinstance(tokenizer, BPETokenizer):
        return tokenizer.hf
    raise TypeError(f"cannot encode conversations with {tokenizer!r}")


@dataclass
class Encoded:
    """A conversation's ids `(N,)` int64 and mask `(N,)` bool: True where the model writes."""

    ids: np.ndarray
    mask: np.ndarray


class ConversationEncoder:
    """Encodes conversations with a template and a tokenizer that holds the chat tokens.

    Raises (at construction):
        InputError: the tokenizer lacks one of the template's chat tokens.
    """

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer) -> None:
        self.template, self.tokenizer = template, tokenizer
        self._hf = _hf(tokenizer)
        missing = [t for t in CHAT_TOKENS if self._hf.token_to_id(t) is None]
        if missing:
            raise InputError(
                f"the tokenizer has no {', '.join(missing)}: a chat run's tokenizer holds the "
                "chat tokens (add_chat_tokens adds them)."
            )
        self.end_id: int = self._hf.token_to_id(CHAT_TOKENS[-1])
        # The tokens that end a reply: the end of turn, and the end of text where the tokenizer
        # has one (a model may write it too). The Hugging Face export lists both as its
        # `eos_token_id`, so generation there (TRL's included) stops at either, as llmcli's does.
        eot = tokenizer.eot_id
        self.reply_end_ids: tuple[int, ...] = (
            (self.end_id,) if eot is None or eot == self.end_id else (self.end_id, eot)
        )
        # What the template reads as bos_token and eos_token: the export's, so that its
        # apply_chat_template renders the text (and ids) encoded here.
        self.special_tokens = special_tokens(eot_text(tokenizer))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
    ) -> Rendered:
        """The template's text of `messages`, with this tokenizer's special tokens."""
        return self.template.render(
            messages, add_generation_prompt, tools=tools, documents=documents, **self.special_tokens
        )

    def encode(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
    ) -> Encoded:
        """A training conversation's ids and mask (`tools` and `documents` for a template that
        writes them)."""
        rendered = self.template.render_training(
            messages, tools=tools, documents=documents, **self.special_tokens
        )
        encoding = self._encode(rendered.text)
        mask = np.zeros(len(encoding.ids), dtype=bool)
        starts = np.array([s for s, _ in encoding.offsets], dtype=np.int64)
        ends = np.array([e for _, e in encoding.offsets], dtype=np.int64)
        for lo, hi in rendered.spans:  # a token is marked when its characters meet the span
            mask |= (starts < hi) & (ends > lo)
        return Encoded(np.asarray(encoding.ids, dtype=np.int64), mask)

    def prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The ids of a conversation to be answered: its turns and the start of the reply."""
        rendered = self.render(messages, True, tools=tools, documents=documents)
        return list(self._encode(rendered.text).ids)

    def _encode(self, text: str) -> Any:
        try:
            return self._hf.encode(text, add_special_tokens=False)
        except Exception as exc:  # tokenizers raises plain Exceptions from its model
            raise self._cannot_encode(text, exc) from None

    def _cannot_encode(self, text: str, exc: Exception) -> InputError:
        """The characters a char tokenizer lacks, named; else what the tokenizer said."""
        return BPETokenizer(self._hf).cannot_encode(text, exc, "conversation")


def add_chat_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` with the chat tokens it lacks added as special tokens, at new ids after the
    last (the model's embedding grows by as many rows); the same tokenizer when it has them."""
    hf = _hf(tokenizer)
    if all(hf.token_to_id(t) is not None for t in CHAT_TOKENS):
        return tokenizer
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    grown = HFTokenizer.from_str(hf.to_str())  # a copy: the original keeps its vocabulary
    grown.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in CHAT_TOKENS
            if hf.token_to_id(t) is None
        ]
    )
    return BPETokenizer(grown)
