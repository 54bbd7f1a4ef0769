"""Streaming: the text of samples written as it is generated, samples generated together in order.

A `TextSink` receives each sample's text as it becomes final (`text(index, piece)`) and the end of
each sample (`end(index)`). `OrderedWriter` is the one `llmcli sample` streams to: it writes
sample 0 as its text arrives and buffers the others until every sample before them has ended, so
that a batch reads as if its samples came one after another (`llmcli.generation.batching` runs
the batch; `llmcli.generation.sample.format_samples` writes the same text once samples are whole).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class TextSink(Protocol):
    """Receives the text of samples as it is generated (see `OrderedWriter`)."""

    def text(self, index: int, piece: str) -> None: ...

    def end(self, index: int) -> None: ...


class OrderedWriter:
    """Writes samples generated together as if one came after another.

    Sample 0 is written as its text arrives; the others are buffered until every sample before
    them has ended. Each sample is its header (the prompt), its text and a newline if the text
    does not end with one; `separator` goes between samples.

    Args:
        write: called with each piece of output (for example `sys.stdout.write` + flush).
        headers: one per sample, written before its text.
        separator: a line written between samples.
    """

    def __init__(
        self, write: Callable[[str], Any], headers: Sequence[str], separator: str = "-" * 15
    ) -> None:
        self.write = write
        self.headers = list(headers)
        self.separator = separator
        self.current = -1
        self.buffers: dict[int, list[str]] = {i: [] for i in range(len(self.headers))}
        self.ended: set[int] = set()
        self.last_char = "\n"
        self._advance()

    def _out(self, text: str) -> None:
        if text:
            self.write(text)
            self.last_char = text[-1]

    def _advance(self) -> None:
        """Move on to the next sample, writing what it buffered, as far as samples have ended."""
        while True:
            if self.current >= 0:
                if self.last_char != "\n":
                    self._out("\n")
                if self.current + 1 < len(self.headers):
                    self._out(self.separator + "\n")
            self.current += 1
            if self.current >= len(self.headers):
                return
            self._out(self.headers[self.current])
            self._out("".join(self.buffers.pop(self.current)))
            if self.current not in self.ended:
                return

    def text(self, index: int, piece: str) -> None:
        if index == self.current:
            self._out(piece)
        elif piece:
            self.buffers[index].append(piece)

    def end(self, index: int) -> None:
        self.ended.add(index)
        if index == self.current:
            self._advance()
