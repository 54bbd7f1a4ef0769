"""Batched autoregressive generation with a KV cache: token ids in, new token ids out.

`generate(model, prompts_ids, max_new_tokens, ...)` is an iterator that yields the `(B,)` new ids
of each step. Prompts of different lengths run as one left-padded batch (a key padding mask
hides the padding, positions count real tokens only) and each row draws from its own
`torch.Generator` (see `llmcli.generation.sampling`), so every prompt gets exactly what it would
get alone with the same seed. The KV cache is prefilled with the prompts, then fed one token per
step.

Past `context_length` a context policy says what the model sees
(`llmcli.generation.context_window`): `exact` recomputes the last `context_length` tokens every
step (a sliding window, as in nanoGPT and litgpt); `shift` keeps the last `keep` tokens, prefills
them again and goes on with the cache. With or without the cache, a policy is the same computation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from llmcli.errors import InputError
from llmcli.generation.context_window import (
    ContextWindow,
    check_context_policy,
    next_logits,
    shift_logits,
)
from llmcli.generation.decode import decoder_for
from llmcli.generation.sampling import GeneratorArg, check_sampling, make_generators, sample_next


def _check_prompts(prompts_ids: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
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


def generate(
    model: Any,
    prompts_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int | None = None,
    generators: Sequence[torch.Generator] | None = None,
    use_cache: bool = True,
    vocab_size: int | None = None,
    context_policy: str = "shift",
    context_keep: int | None = None,
) -> Iterator[Tensor]:
    """Generate for a batch of prompts, one step at a time.

    Prompts of different lengths are left-padded into one batch; row `b` gets exactly the tokens
    it would get alone with the generator `generators[b]` (by default seeded `seed + b`) and the
    same context policy. Prompts longer than `context_length` are cropped to their last
    `context_length` tokens.

    Args:
        model: a `llmcli.model.gpt.Transformer` in eval mode (or anything with its `forward`,
            `new_kv_cache` and `context_length`).
        prompts_ids: B non-empty lists of token ids.
        max_new_tokens: steps to run (the caller may stop earlier by leaving the loop).
        temperature, top_k, top_p: see `llmcli.generation.sampling.sample_next`.
        seed: seeds the per-row generators `seed + b` (ignored with `generators`; a fresh random
            seed when both are None). Unused at temperature 0.
        generators: B generators, one per row, advanced in place.
        use_cache: prefill a KV cache and feed one token per step (False: recompute the whole
            window each step, the nanoGPT way; same tokens, slower).
        vocab_size: sample only among ids `< vocab_size` (a model's vocabulary may be padded
            beyond its tokenizer's).
        context_policy: past `context_length`, "shift" (keep the last `context_keep` tokens,
            prefill them again, go on with the cache; the default, as in `llmcli sample`) or
            "exact" (the last `context_length` tokens, recomputed every step); see
            `llmcli.generation.context_window`.
        context_keep: tokens `shift` keeps, in `1 .. context_length - 1` (None: half the
            context).

    Yields:
        `(B,)` long tensors on the model's device: the new token of every row, step by step.

    Raises:
        InputError: (at the first step) sampling controls out of range, a negative
            `max_new_tokens`, an unknown context policy or a `context_keep` out of range, empty
            prompts or ids outside the vocabulary, a wrong number of generators.
    """
    check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens ({max_new_tokens}) must be >= 0")
    context_keep = check_context_policy(context_policy, context_keep, model.context_length)
    yield from _generate(
        model,
        prompts_ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        generators=generators,
        use_cache=use_cache,
        vocab_size=vocab_size,
        context_policy=context_policy,
        context_keep=context_keep,
    )


def _generate(
    model: Any,
    prompts_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float,
    seed: int | None,
    generators: Sequence[torch.Generator] | None,
    use_cache: bool,
    vocab_size: int | None,
    context_policy: str,
    context_keep: int,
) -> Iterator[Tensor]:
    """The loop of `generate`, trusting its sampling controls, `max_new_tokens` and context
    policy (`context_keep` resolved: a number of tokens).

    For callers that have already checked them once (`llmcli.generation.sample`); the prompts are
    still checked against the model's vocabulary here, as they are turned into rows.
    """
    rows = _check_prompts(prompts_ids, model.vocab_size)
    B, C = len(rows), model.context_length
    rows = [row[-C:] for row in rows]
    if generators is not None and len(generators) != B:
        raise InputError(f"got {len(generators)} generators for {B} prompts")
    if temperature > 0 and generators is None:
        generators = make_generators(B, seed)
    gens: GeneratorArg = None if temperature == 0 else generators
    if gens is not None and len(gens) == 1:
        gens = gens[0]  # one draw per step instead of a list of one
    device = next(model.parameters()).device
    with torch.inference_mode():
        window = ContextWindow(rows, max_new_tokens, C, device)
        shift = context_policy == "shift"
        # exact: a prompt that fills the context slides the window at the first step already.
        fits = shift or window.end < C
        cache = model.new_kv_cache(B) if use_cache and fits and max_new_tokens > 0 else None
        decoder = None if cache is None else decoder_for(model)
    for _ in range(max_new_tokens):
        with torch.inference_mode():
            if shift:
                logits = shift_logits(model, window, cache, context_keep, decoder)  # (B, V)
            else:
                logits = next_logits(model, window, cache, decoder)  # (B, V)
            if vocab_size is not None:
                logits = logits[:, :vocab_size]  # (B, vocab_size)
            next_ids = sample_next(logits, gens, temperature, top_k, top_p)  # (B,)
            window.append(next_ids)
        yield next_ids


def generate_ids(
    model: Any, prompts_ids: Sequence[Sequence[int]], max_new_tokens: int, **kwargs: Any
) -> list[list[int]]:
    """`generate` run to the end: the new ids of every prompt, `B` lists of `max_new_tokens`."""
    steps = [step.cpu() for step in generate(model, prompts_ids, max_new_tokens, **kwargs)]
    if not steps:
        return [[] for _ in prompts_ids]
    return torch.stack(steps, dim=1).tolist()  # (B, N)
