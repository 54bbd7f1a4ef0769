"""Batched autoregressive generation with a KV cache: token ids in, new token ids out.

`generate(model, prompts_ids, config)` is an iterator that yields the `(B,)` new ids of each step,
drawn with the settings of a `llmcli.config.SampleConfig`. The KV cache is prefilled with the
prompts, then fed one token per step, through the model's own forward (or an opt-in faster
step, `decode`). Prompts of different lengths run as one left-padded batch (the attention mask
hides the padding and positions count real tokens only: `llmcli.generation.padding`) and each
row draws from its own `torch.Generator` (`llmcli.generation.sampling`), so every prompt gets
exactly what it would get alone with the same seed.

Past `context_length` a context policy says what the model sees
(`llmcli.generation.context_window`): `exact` recomputes the last `context_length` tokens every
step (a sliding window, as in nanoGPT and litgpt); `shift` keeps the last `keep` tokens, prefills
them again and goes on with the cache. With or without the cache, a policy is the same computation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from llmcli.config import SampleConfig
from llmcli.errors import InputError
from llmcli.generation.context_window import ContextWindow
from llmcli.generation.prompts import check_prompt_ids
from llmcli.generation.sampling import GeneratorArg, make_generators, sample_next
from llmcli.model.kv_cache import KVCache

#: A faster stand-in for the model's forward on one new token per row (`FastDecoder`):
#: `(idx (B,), cache, mask, input_pos) -> logits (B, V)`, or None where it does not apply now.
DecodeStep = Callable[[Tensor, KVCache, Tensor | None, Tensor | None], Tensor | None]


def generate(
    model: Any,
    prompts_ids: Sequence[Sequence[int]],
    config: SampleConfig,
    *,
    generators: Sequence[torch.Generator] | None = None,
    use_cache: bool = True,
    vocab_size: int | None = None,
    observe: Callable[[Tensor, Tensor], Any] | None = None,
    decode: DecodeStep | None = None,
) -> Iterator[Tensor]:
    """Generate for a batch of prompts, one step at a time.

    Prompts of different lengths are left-padded into one batch; row `b` gets exactly the tokens
    it would get alone with the generator `generators[b]` (by default seeded `config.seed + b`)
    and the same settings. Prompts longer than `context_length` are cropped to their last
    `context_length` tokens.

    Args:
        model: a `llmcli.model.gpt.Transformer` in eval mode (or anything with its `forward`,
            `new_kv_cache` and `context_length`).
        prompts_ids: B non-empty lists of token ids.
        config: the sampling settings, checked when the config was made: `max_new_tokens` steps
            (the caller may stop earlier by leaving the loop); `temperature`, `top_k`, `top_p`
            (see `llmcli.generation.sampling.sample_next`); `seed` for the per-row generators
            (ignored with `generators`, unused at temperature 0); past `context_length`,
            `context_policy` "shift" (keep the last `context_keep` tokens, prefill them again,
            go on with the cache) or "exact" (the last `context_length` tokens, recomputed
            every step), see `llmcli.generation.context_window`.
        generators: B generators, one per row, advanced in place.
        use_cache: prefill a KV cache and feed one token per step (False: recompute the whole
            window each step, the nanoGPT way; same tokens, slower).
        vocab_size: sample only among ids `< vocab_size` (a model's vocabulary may be padded
            beyond its tokenizer's).
        observe: called at every step with the logits `(B, V)` the step drew from (cropped to
            `vocab_size`) and the ids drawn `(B,)`, before they are yielded (the server's
            log-probs); it must not change them.
        decode: runs the one-token steps in the model's place where it applies (a
            `llmcli.generation.fast_decode.FastDecoder`: the same logits, faster on a small
            model); None: every step is the model's forward.

    Yields:
        `(B,)` long tensors on the model's device: the new token of every row, step by step.

    Raises:
        InputError: (at the first step) a `context_keep` outside `1 .. context_length - 1`,
            empty prompts or ids outside the vocabulary, a wrong number of generators.
    """
    keep = config.keep_for(model.context_length)
    rows = check_prompt_ids(prompts_ids, model.vocab_size)
    B, C = len(rows), model.context_length
    rows = [row[-C:] for row in rows]
    gens = _row_generators(config, generators, B)
    device = next(model.parameters()).device
    n = config.max_new_tokens
    shift = config.context_policy == "shift"
    with torch.inference_mode():
        window = ContextWindow(rows, n, C, device)
        # exact: a prompt that fills the context slides the window at the first step already.
        cache = model.new_kv_cache(B) if use_cache and (shift or window.end < C) else None
    for _ in range(n):
        with torch.inference_mode():
            logits = next_logits(model, window, cache, shift, keep, decode)  # (B, V)
            if vocab_size is not None:
                logits = logits[:, :vocab_size]  # (B, vocab_size)
            next_ids = sample_next(
                logits, gens, config.temperature, config.top_k, config.top_p
            )  # (B,)
            window.append(next_ids)
            if observe is not None:
                observe(logits, next_ids)
        yield next_ids


def next_logits(
    model: Any,
    window: ContextWindow,
    cache: KVCache | None,
    shift: bool,
    keep: int,
    decode: DecodeStep | None = None,
) -> Tensor:
    """Logits `(B, V)` of the token after column `end - 1`, under the context policy (`shift`,
    keeping the last `keep` tokens when the context is full, or `exact`).

    With a cache, inside the context: the whole window into an empty cache, then one column per
    step, through `decode` where it applies (the same logits, faster). Without a cache, or
    `exact` past the context: the last `context_length` columns recomputed.
    """
    C = model.context_length
    if shift and window.end > C:
        window.keep_last(keep)  # start again from each row's last tokens
        if cache is not None:
            cache.reset()
    if cache is None or window.end > C:
        idx, mask, pos = window.inputs(max(0, window.end - C))
        logits, _ = model(idx, mask=mask, input_pos=pos)
        return logits[:, -1]  # (B, T, V) -> (B, V)
    if window.cached == 0:  # prefill the prompts
        idx, mask, pos = window.inputs(0)
    else:  # the newest column; the cache holds the ones before it
        idx, mask, pos = window.newest_inputs()
        logits = None if decode is None else decode(idx[:, 0], cache, mask, pos)
        if logits is not None:
            window.cached = window.end
            return logits
    logits, _ = model(idx, mask=mask, input_pos=pos, kv_cache=cache)
    window.cached = window.end
    return logits[:, -1]  # (B, T, V) -> (B, V)


def generate_ids(
    model: Any, prompts_ids: Sequence[Sequence[int]], config: SampleConfig, **kwargs: Any
) -> list[list[int]]:
    """`generate` run to the end: the new ids of every prompt, `B` lists of
    `config.max_new_tokens`."""
    steps = [step.cpu() for step in generate(model, prompts_ids, config, **kwargs)]
    return torch.stack(steps, dim=1).tolist()  # (B, N)


def _row_generators(
    config: SampleConfig, generators: Sequence[torch.Generator] | None, B: int
) -> GeneratorArg:
    """What `sample_next` draws from: None at temperature 0, else one generator per row
    (`generators`, or seeded `config.seed + b`), a single one for a batch of one."""
    if generators is not None and len(generators) != B:
        raise InputError(f"got {len(generators)} generators for {B} prompts")
    if config.temperature == 0:
        return None
    gens = make_generators(B, config.seed) if generators is None else generators
    return gens[0] if len(gens) == 1 else gens  # one draw per step instead of a list of one
