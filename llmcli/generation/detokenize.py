"""Detokenizing as tokens come: one sample's new token ids turned into final text, stop strings
held back.

`TextState.push(token)` returns the text that can no longer change: text that could still be the
start of a stop string waits for the next tokens, as does a token that ends inside a multi-byte
character (byte-level BPE); a stop string or a stop id ends the sample, neither of them part of
its text. `llmcli.generation.batching` keeps one per row of a batch and sends what it releases
to a `llmcli.generation.streaming.TextSink`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from llmcli.data.tokenizer import CharTokenizer, Tokenizer


class TextState:
    """One sample's new tokens turned into text, with stop strings held back.

    Text is released only when it can no longer be the start of a stop string, and tokens that
    end inside a multi-byte character (byte-level BPE) wait for the rest of the character.
    New tokens are decoded after a few tokens of context (the prompt's at first), as some
    decoders treat the start of a text specially (SentencePiece drops a leading space).
    """

    # Up to 4 bytes make one UTF-8 character; a byte-level token holds at least one.
    MAX_PENDING = 4
    CONTEXT = 4

    def __init__(
        self,
        tokenizer: Tokenizer,
        stops: Sequence[str],
        stop_ids: set[int],
        context: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        # A char tokenizer's token is its text alone: no context, no partial characters.
        self.token_texts = tokenizer.token_texts if isinstance(tokenizer, CharTokenizer) else None
        self.stops = [s for s in stops if s]
        self.stop_ids = stop_ids
        self.context = list(context)[-self.CONTEXT :]
        self.ids: list[int] = []
        self.decoded = 0  # ids[:decoded] are in `text`
        self.text = ""
        self.emitted = 0  # text[:emitted] has been released
        self.done = False
        self.stop_reason: Literal["length", "stop"] = "length"

    def push(self, token: int) -> str:
        """Add one token; returns the text that is now final."""
        self.ids.append(token)
        if token in self.stop_ids:
            self.done, self.stop_reason = True, "stop"
            return self.finish(include_last=False)
        piece = self._decode(len(self.ids))
        if piece.endswith("\ufffd") and len(self.ids) - self.decoded < self.MAX_PENDING:
            return ""
        self.decoded = len(self.ids)
        return self._add(piece)

    def _decode(self, upto: int) -> str:
        """The text of `ids[decoded:upto]`, decoded after up to CONTEXT earlier tokens."""
        new = self.ids[self.decoded : upto]
        if self.token_texts is not None:
            return "".join([self.token_texts[i] for i in new])
        n = self.CONTEXT
        if self.decoded >= n:
            ctx = self.ids[self.decoded - n : self.decoded]
        else:
            ctx = self.context[max(0, len(self.context) - (n - self.decoded)) :]
            ctx = ctx + self.ids[: self.decoded]
        if not ctx:
            return self.tokenizer.decode(new)
        base = self.tokenizer.decode(ctx)
        full = self.tokenizer.decode(ctx + new)
        return full[len(base) :] if full.startswith(base) else self.tokenizer.decode(new)

    def _add(self, piece: str) -> str:
        self.text += piece
        if self.stops:
            hits = [i for i in (self.text.find(s, self.emitted) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.done, self.stop_reason = True, "stop"
                return self._release(len(self.text))
            return self._release(len(self.text) - self._held())
        return self._release(len(self.text))

    def _held(self) -> int:
        """Length of the longest end of `text` that could begin a stop string."""
        tail = self.text[self.emitted :]
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, upto: int) -> str:
        out = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return out

    def finish(self, include_last: bool = True) -> str:
        """End the sample: decode what is pending and release everything held back."""
        stop = len(self.ids) if include_last else len(self.ids) - 1
        if self.decoded < stop:
            self.text += self._decode(stop)
            self.decoded = stop
        self.done = True
        return self._release(len(self.text))
