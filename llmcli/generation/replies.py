"""Replies: each prompt's new tokens up to its end token or its budget, for evaluation and GRPO.

`llmcli eval --answers` compares greedy replies with the expected ones, and GRPO rewards sampled
ones; both generate a batch of prompts together (`llmcli.generation.engine.generate`, each row
exactly what it would get alone) and cut each row at its first end token (the end of turn, or
the end of text: `ConversationEncoder.reply_end_ids`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch

from llmcli.generation.engine import DecodeStep, generate


def replies(
    model: Any,
    prompts: list[list[int]],
    budgets: list[int],
    end_ids: Sequence[int],
    sample: Any,
    vocab_size: int | None = None,
    *,
    generators: Sequence[torch.Generator] | None = None,
    decode: DecodeStep | Literal["auto"] | None = "auto",
) -> list[tuple[list[int], int | None]]:
    """Each prompt's reply before its first token of `end_ids`, and that token, where it came
    within the prompt's budget of tokens (None: the reply was cut at its budget).

    Args:
        model: a model in eval mode.
        prompts: B lists of ids.
        budgets: each prompt's most new tokens: a reply stops there, or earlier at its end
            token (so a reply and its end token are at most the budget).
        end_ids: the tokens that end a reply (left out of it).
        sample: the `SampleConfig` the tokens are drawn with (temperature 0: greedy); its
            `max_new_tokens` is replaced by the largest budget.
        vocab_size: only ids below it are drawn (a model's vocabulary may be padded beyond its
            tokenizer's).
        generators: one per row (default: seeded from `sample.seed`, as `generate` seeds them).
        decode: the one-token step in the model's place, as `generate`'s.
    """
    config = dataclasses.replace(sample, max_new_tokens=max(budgets))
    out: list[list[int]] = [[] for _ in prompts]
    ended: list[int | None] = [None] * len(prompts)
    done = [False] * len(prompts)
    steps = generate(
        model, prompts, config, generators=generators, vocab_size=vocab_size, decode=decode
    )
    for step in steps:  # (B,) each step
        for b, token in enumerate(step.tolist()):
            if done[b]:
                continue
            if token in end_ids:
                ended[b], done[b] = token, True
            else:
                out[b].append(token)
                done[b] = len(out[b]) >= budgets[b]
        if all(done):
            break
    return list(zip(out, ended, strict=True))
