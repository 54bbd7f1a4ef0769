"""Streaming (llmcli/generation/streaming.py): `OrderedWriter` writes samples generated together
in order, as if one came after another."""

from __future__ import annotations

from llmcli.generation.streaming import OrderedWriter


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
