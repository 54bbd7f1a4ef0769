"""Preference pairs: a prompt, the reply people preferred and the one they did not, for DPO.

A row is TRL's shape (`DPOTrainer`'s "explicit prompt" preference data), in one of two forms:

- text: `{"prompt": "...", "chosen": "...", "rejected": "..."}`;
- conversational: `{"prompt": [messages], "chosen": [one assistant message], "rejected": [one
  assistant message]}`, the prompt a conversation that ends with the user's turn
  (`llmcli.data.conversations.check_messages`); or TRL's implicit-prompt form, without
  `prompt`, each reply a whole conversation whose shared first messages are the prompt.

`PreferenceEncoder` turns a pair into ids as TRL's `DPOTrainer._prepare_dataset` does: the prompt
and each prompt + completion are encoded whole (a conversation through the run's chat template,
`ConversationEncoder`), and the completion is what follows the longest prefix the prompt shares
with both (tokens may merge across the join, and a template may render a prompt alone otherwise).
A text completion gets the end-of-text token appended first, as TRL appends `eos_token` to text
completions; a conversational one ends with the end-of-turn token the template writes.

DPO trains on these pairs (`train.objective: dpo`, `llmcli.objectives.dpo`), and `llmcli eval`
scores a run on them (`llmcli.evaluation.preferences`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmcli.data.chat_template import ChatTemplate
from llmcli.data.conversations import (
    ConversationEncoder,
    Messages,
    check_messages,
    read_jsonl_rows,
)
from llmcli.data.tokenizer import Tokenizer, eot_text
from llmcli.errors import InputError

KEYS = ("prompt", "chosen", "rejected")
SHAPE = '"prompt", "chosen" and "rejected", each text or a list of {role, content} messages'


@dataclass(frozen=True)
class Preference:
    """One checked row: all text (`str`), or all messages (`chosen` and `rejected` each a list of
    one assistant message); `where` names the row ("prefs.jsonl line 4")."""

    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages
    where: str

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def check_preference(row: Mapping[str, Any], where: str) -> Preference:
    """`row` as a `Preference`, or an `InputError` naming `where` and the fix.

    Raises:
        InputError: a missing key, a prompt that is neither text nor messages, forms that differ
            (a text prompt with message replies), a reply that is not one assistant message,
            chosen identical to rejected.
    """
    row = with_explicit_prompt(row)
    missing = [key for key in KEYS if key not in row]
    if missing:
        raise InputError(
            f"{where}: a preference row must have {SHAPE} (it has no "
            f"{', '.join(map(repr, missing))})."
        )
    prompt = row["prompt"]
    if isinstance(prompt, str):
        replies = [_text_reply(row[key], key, where) for key in KEYS[1:]]
    elif isinstance(prompt, list):
        prompt = check_messages(prompt, where, complete=False, field="prompt")
        replies = [_message_reply(prompt, row[key], key, where) for key in KEYS[1:]]
    else:
        raise InputError(
            f"{where}: 'prompt' must be text or a list of {{role, content}} messages ending with "
            f"the user's turn (got {type(prompt).__name__})."
        )
    chosen, rejected = replies
    if chosen == rejected:
        raise InputError(
            f"{where}: 'chosen' and 'rejected' are the same reply, so there is no preference to "
            "learn: fix the row or drop it."
        )
    return Preference(prompt, chosen, rejected, where)


def with_explicit_prompt(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """A row in TRL's implicit-prompt form (no `prompt`; `chosen` and `rejected` whole
    conversations that share their first messages, as many Hub preference sets are) split as
    TRL's `extract_prompt` splits it: the shared messages are the prompt, the rest each reply.
    Any other row is returned as it is."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    # (A `datasets` table whose other rows have a prompt gives this one None.)
    if row.get("prompt") is not None or not (
        isinstance(chosen, list) and isinstance(rejected, list)
    ):
        return row
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    return {
        **row,
        "prompt": chosen[:shared],
        "chosen": chosen[shared:],
        "rejected": rejected[shared:],
    }


def _text_reply(reply: Any, key: str, where: str) -> str:
    if not isinstance(reply, str):
        raise InputError(
            f"{where}: the prompt is text, so {key!r} must be text too (got "
            f"{type(reply).__name__}); for messages, give the prompt as messages as well."
        )
    return reply


def _message_reply(prompt: Messages, reply: Any, key: str, where: str) -> Messages:
    """`reply` checked as one assistant message answering `prompt`."""
    if not (
        isinstance(reply, list)
        and len(reply) == 1
        and isinstance(reply[0], dict)
        and reply[0].get("role") == "assistant"
    ):
        raise InputError(
            f"{where}: the prompt is messages, so {key!r} must be a list of one assistant "
            'message, [{"role": "assistant", "content": "..."}].'
        )
    # The whole conversation checked, so that the reply's text meets the rules of any turn.
    return check_messages([*prompt, *reply], f"{where} (prompt + {key})")[-1:]


def read_preferences(path: Path) -> Iterator[Preference]:
    """The checked rows of a JSONL file of preference pairs.

    Raises:
        InputError: a line that is not JSON or not a preference row, naming the file and line.
    """
    for row, where in read_jsonl_rows(path, KEYS[1:], SHAPE):  # the prompt may be implicit
        yield check_preference(row, where)


# --- Ids ----------------------------------------------------------------------------------


@dataclass
class EncodedPair:
    """A pair's ids, each `(N,)` int64: the prompt's, and each completion's after it."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


class PreferenceEncoder:
    """Encodes preference pairs with a run's tokenizer and, for conversational rows, its chat
    template (None: a run without one, which reads text rows only)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None) -> None:
        self.tokenizer = tokenizer
        self.conversations = None if template is None else ConversationEncoder(template, tokenizer)
        self.eot = eot_text(tokenizer)

    @property
    def pad_id(self) -> int:
        """The id after a sequence's end in a batch (never scored): the end-of-turn token with
        a template, else 0."""
        return self.conversations.end_id if self.conversations is not None else 0

    def encode(self, pair: Preference) -> EncodedPair:
        """`pair`'s prompt and completion ids, as TRL's `DPOTrainer` tokenizes the row.

        Raises:
            InputError: naming the row: a conversational row for a run without a chat template,
                a text row for a tokenizer without an end-of-text token, text the tokenizer
                cannot encode.
        """
        try:
            if pair.conversational:
                prompt, chosen, rejected = self._conversation(pair)
            else:
                prompt, chosen, rejected = self._text(pair)
        except InputError as exc:
            raise InputError(f"{pair.where}: {exc}") from None
        # Where the prompt stops agreeing with either whole sequence, the completions start.
        start = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
        return EncodedPair(
            np.asarray(prompt[:start], dtype=np.int64),
            np.asarray(chosen[start:], dtype=np.int64),
            np.asarray(rejected[start:], dtype=np.int64),
        )

    def _conversation(self, pair: Preference) -> tuple[list[int], list[int], list[int]]:
        if self.conversations is None:
            raise InputError(
                "the row is messages, and the run has no chat template to render them: give "
                "the rows as text, or start from a chat run."
            )
        assert isinstance(pair.prompt, list)  # conversational: all three are messages
        encode = self.conversations.encode
        return (
            self.conversations.prompt(pair.prompt),
            encode([*pair.prompt, *pair.chosen]).ids.tolist(),
            encode([*pair.prompt, *pair.rejected]).ids.tolist(),
        )

    def _text(self, pair: Preference) -> tuple[list[int], list[int], list[int]]:
        if self.eot is None:
            raise InputError(
                "a text completion ends with the end-of-text token, and this tokenizer has "
                "none: give the rows as messages, or use a tokenizer with one."
            )
        prompt, encode = str(pair.prompt), self.tokenizer.encode
        return (
            encode(prompt),
            encode(prompt + _ending(str(pair.chosen), self.eot)),
            encode(prompt + _ending(str(pair.rejected), self.eot)),
        )


def _ending(text: str, eot: str) -> str:
    """`text` ending with `eot`, as TRL's `add_eos` leaves it (once, not twice)."""
    return text if text.endswith(eot) else text + eot


def _common_prefix(ids: list[int], other: list[int]) -> int:
    """How many leading ids `ids` and `other` share (TRL's `common_prefix_length`)."""
    n = 0
    while n < min(len(ids), len(other)) and ids[n] == other[n]:
        n += 1
    return n
