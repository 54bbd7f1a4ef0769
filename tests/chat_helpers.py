"""Shared by the chat tests: a few conversations and a readable chat run with a tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import save_tiny_run

from llmcli.data.chat_template import default_template
from llmcli.data.conversations import add_chat_tokens
from llmcli.data.tokenizer import CharTokenizer, Tokenizer

CONVERSATIONS: list[list[dict[str, str]]] = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
    ],
    [
        {"role": "user", "content": "Spell cat."},
        {"role": "assistant", "content": "c-a-t"},
        {"role": "user", "content": "And dog?"},
        {"role": "assistant", "content": "d-o-g"},
    ],
]

CHARS = "\n !'-.,:;?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def chat_tokenizer() -> Tokenizer:
    """A char tokenizer over `CHARS`, with the chat tokens added."""
    return add_chat_tokens(CharTokenizer(CHARS))


def save_chat_run(
    run_dir: Path, *, seed: int = 0, sharpen: float | None = 3.0, **model: Any
) -> Path:
    """A readable run (no resume state) of a tiny untrained model that holds the built-in
    chat template and a tokenizer with the chat tokens; `model` overrides `ModelConfig` keys."""
    raw = {
        "model": {"n_layer": 2, "n_head": 2, "n_embed": 32, "context_length": 64, **model},
        "data": {"format": "chat"},
    }
    save_tiny_run(run_dir, chat_tokenizer(), raw, seed=seed, sharpen=sharpen)
    default_template().save(run_dir)
    return run_dir
