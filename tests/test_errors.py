"""llmcli.errors: the hint that names what an unknown word was probably meant to be."""

from __future__ import annotations

from llmcli.errors import did_you_mean


def test_did_you_mean_names_the_closest_choices_or_nothing() -> None:
    sections = ["model", "data", "train", "sample"]
    assert did_you_mean("trian", sections) == " Did you mean 'train'?"
    assert did_you_mean("xyz", sections) == ""
    assert did_you_mean("lr_min", ["min_lr", "lr", "seed"], " Did you mean 'train.{}'?") in (
        " Did you mean 'train.min_lr'?",
        " Did you mean 'train.lr'?",
    )
    points = ["blocks.0.attn_out", "blocks.1.attn_out", "blocks.0.mlp_out", "embed"]
    hint = did_you_mean("blocks.0.attnout", points, "did you mean {}? ", n=3, cutoff=0.6)
    assert hint.startswith("did you mean blocks.0.attn_out, ") and hint.endswith("? ")
    assert did_you_mean("embed", points, n=1, cutoff=0.99) == " Did you mean 'embed'?"


def test_did_you_mean_takes_the_choices_a_word_begins() -> None:
    commands = ["reset", "system", "temperature", "top_k", "top_p"]
    # "system" is closer to "temp" by difflib's ratio (0.6 against 0.53); the word begins one.
    assert did_you_mean("temp", commands, " /{}?") == " /temperature?"
    assert did_you_mean("/top", [f"/{c}" for c in commands], " {}?") == " /top_k or /top_p?"
    assert did_you_mean("", commands) == ""
