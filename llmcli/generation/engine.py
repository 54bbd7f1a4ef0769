"""The generation engine: batched autoregressive generation with a KV cache, token ids in, new
token ids out; what `llmcli sample`, `llmcli chat`, `llmcli serve` and `llmcli bench` run.

`generate(model, prompts_ids, config)` is an iterator that yields the `(B,)` new ids of each step,
drawn with the settings of a `llmcli.config.SampleConfig`. The KV cache is prefilled with the
prompts, then fed one token per step: through `llmcli.generation.fast_decode`'s step where it
applies (the default; the forward's logits, faster), else the model's own forward. It computes
what the plain loop of `llmcli.generation.loop` computes for each prompt alone (the tests check
it token for token); what it adds is speed and batches:

- left padding: prompts of different lengths run as one batch, left-padded so that all rows end
  at one column. `padded_mask` and `padded_positions` build what the model's forward takes
  (`mask`, `input_pos`) so that each row computes exactly what it would compute alone: no token
  attends to a padding key; positions count real tokens only (a row's first real token is at
  position 0); a padding query, which has no real key at or before it, attends to itself alone,
  so that no softmax row is empty (its output is never read). Each row draws from its own
  `torch.Generator` (`llmcli.generation.sampling`), so every prompt gets exactly what it would
  get alone with the same seed.
- the context window (`ContextWindow`): the batch's tokens, the model's inputs for each step,
  and which columns the KV cache holds. Inside the context both policies prefill the cache once
  and then feed one token per step. Past `context_length` the context policy says what the
  model sees:

  - `exact`: the last `context_length` tokens, recomputed every step (nanoGPT's and litgpt's
    sliding window). Positions are absolute (learned, or rotary from 0 at the window's start),
    so once the window slides every cached key is stale.
  - `shift`: when the cache is full, the last `keep` tokens are prefilled again in one forward
    pass at positions `0 .. keep - 1` and decoding goes on one token per step with the cache
    (llama.cpp's context shift for models whose positions cannot be moved in place). The model
    then sees between `keep` and `context_length` tokens, and each step is a decode step except
    one re-prefill every `context_length - keep + 1` steps.

  Rotary keys could instead be rotated in place to their new positions, which equals the
  re-prefill in the first layer only (deeper layers' keys also hold what the dropped tokens
  contributed); the re-prefill keeps `shift` exactly "the model run on the kept tokens", which
  the tests check against a plain loop. Without the cache (every step the whole window
  recomputed) the computation is `llmcli.generation.loop`'s: that loop is the uncached path.
- one prefill per prompt: rows that repeat a prompt (`llmcli sample --num-samples`, the server's
  `n`, a group of completions drawn per prompt) need its keys and values only once. The
  prefill runs on each distinct row (`distinct_rows`: the same tokens after the same padding)
  into a cache of its own, whose rows are then copied to every row of their prompt
  (`shared_prefill`, `KVCache.copy_rows`); from there each row decodes and draws on its own.
  A `shift` re-prefill shares the same way where rows are still the same (greedy ones are).
  On the `tiny` shape, 8 samples of a 48-token prompt take 0.69x the time of every row
  prefilled, the same tokens (benchmarks/shared_prefill.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from llmcli.config import SampleConfig
from llmcli.errors import InputError
from llmcli.generation.fast_decode import FastDecoder
from llmcli.generation.prompts import check_prompt_ids
from llmcli.generation.sampling import GeneratorArg, make_generators, sample_next
from llmcli.model.gpt import causal_mask
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
    vocab_size: int | None = None,
    observe: Callable[[Tensor, Tensor], Any] | None = None,
    decode: DecodeStep | Literal["auto"] | None = "auto",
) -> Iterator[Tensor]:
    """Generate for a batch of prompts, one step at a time.

    Prompts of different lengths are left-padded into one batch; row `b` gets exactly the tokens
    it would get alone with the generator `generators[b]` (by default seeded `config.seed + b`)
    and the same settings. Prompts longer than `context_length` are cropped to their last
    `context_length` tokens. Rows that repeat a prompt share its prefill (`ContextWindow.prefill`):
    hook functions see each distinct prompt once there.

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
            every step), see `ContextWindow`.
        generators: B generators, one per row, advanced in place.
        vocab_size: sample only among ids `< vocab_size` (a model's vocabulary may be padded
            beyond its tokenizer's).
        observe: called at every step with the logits `(B, V)` the step drew from (cropped to
            `vocab_size`) and the ids drawn `(B,)`, before they are yielded (the server's
            log-probs); it must not change them.
        decode: runs the one-token steps in the model's place where it applies: "auto" (the
            default) a `llmcli.generation.fast_decode.FastDecoder` for a model it serves (the
            same logits, faster), another step function, or None: every step is the model's
            forward.

    Yields:
        `(B,)` long tensors on the model's device: the new token of every row, step by step.

    Raises:
        InputError: (at the first step) a `context_keep` outside `1 .. context_length - 1`,
            empty prompts or ids outside the vocabulary, a wrong number of generators.
    """
    keep = config.keep_for(model.context_length)
    rows = check_prompt_ids(prompts_ids, model.vocab_size)
    B, ctx = len(rows), model.context_length
    rows = [row[-ctx:] for row in rows]
    gens = _row_generators(config, generators, B)
    device = next(model.parameters()).device
    n = config.max_new_tokens
    shift = config.context_policy == "shift"
    if decode == "auto":
        decode = FastDecoder.for_model(model)
    with torch.inference_mode():
        # exact: a prompt that fills the context slides the window at the first step already.
        cache = model.new_kv_cache(B) if shift or max(map(len, rows)) < ctx else None
        window = ContextWindow(rows, n, ctx, device, cache=cache, keep=keep if shift else None)
    for _ in range(n):
        with torch.inference_mode():
            logits = next_logits(model, window, decode)  # (B, V)
            if vocab_size is not None:
                logits = logits[:, :vocab_size]  # (B, vocab_size)
            next_ids = sample_next(
                logits, gens, config.temperature, config.top_k, config.top_p
            )  # (B,)
            window.append(next_ids)
            if observe is not None:
                observe(logits, next_ids)
        yield next_ids


def generate_ids(
    model: Any, prompts_ids: Sequence[Sequence[int]], config: SampleConfig, **kwargs: Any
) -> list[list[int]]:
    """`generate` run to the end: the new ids of every prompt, `B` lists of
    `config.max_new_tokens`."""
    steps = [step.cpu() for step in generate(model, prompts_ids, config, **kwargs)]
    return torch.stack(steps, dim=1).tolist()  # (B, N)


def next_logits(model: Any, window: ContextWindow, decode: DecodeStep | None = None) -> Tensor:
    """Logits `(B, V)` of the token after the window's last column: the model run on what the
    window gives for this step (`ContextWindow.step`), a decode step through `decode` where it
    applies (the same logits, faster)."""
    step = window.step()
    logits = None
    if step.decode_step and decode is not None and step.cache is not None:
        logits = decode(step.idx.select(1, 0), step.cache, step.mask, step.input_pos)  # (B, V)
    elif step.groups is not None:
        logits = shared_prefill(model, step)  # (B, V)
    if logits is None:
        out, _ = model(step.idx, mask=step.mask, input_pos=step.input_pos, kv_cache=step.cache)
        logits = out[:, -1]  # (B, T, V) -> (B, V)
    if step.cache is not None:
        window.mark_cached()
    return logits


def shared_prefill(model: Any, step: Step) -> Tensor:
    """Logits `(B, V)` of a prefill shared by rows that repeat: the model run on the distinct
    rows `step.idx` `(U, T)` into a cache of their own, whose rows are then copied to the
    batch's cache (`step.groups`), as are the logits."""
    U, T = step.idx.shape
    cache = model.new_kv_cache(U, max_len=T)
    out, _ = model(step.idx, mask=step.mask, input_pos=step.input_pos, kv_cache=cache)
    step.cache.copy_rows(cache, step.groups)
    return out[:, -1].index_select(0, step.groups)  # (U, T, V) -> (U, V) -> (B, V)


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


# ----------------------------------------------------------------------------- the window


class Step(NamedTuple):
    """What the model runs at one step: `model(idx, mask=mask, input_pos=input_pos,
    kv_cache=cache)`, its last position's logits being the step's.

    Attributes:
        idx: `(B, T)` token ids: the whole visible window, or its newest column.
        mask: `(B, 1, T, T_k)` bool, or None for the model's causal default (no padding seen).
        input_pos: `(B, T)` long positions, or None for the default ones.
        cache: the KV cache to read and fill, or None for a forward without one.
        decode_step: `idx` is the newest column after the cached ones (a `decode` step may run
            it in the model's place).
        groups: None, or for a prefill shared by rows that repeat (`shared_prefill`): `(B,)`
            long, which row of `idx`, `mask` and `input_pos` (each distinct row once, `U < B`
            rows) is each row of the batch's; the model then runs them into a cache of `U`
            rows, copied into `cache`.
    """

    idx: Tensor
    mask: Tensor | None
    input_pos: Tensor | None
    cache: KVCache | None
    decode_step: bool
    groups: Tensor | None = None


class ContextWindow:
    """The token buffer of a left-padded batch, the model's inputs for each step under the
    context policy, and which columns the KV cache holds.

    Row `b` holds `pads[b]` padding columns, its prompt, then its new tokens; all rows end at
    column `end`. The buffer is preallocated, so a step only writes one column; for long
    generations it holds `P + 2 * context_length` columns and drops the columns the model can
    no longer see when it is full.

    A step is `step()` (the inputs), the model's forward on them, `mark_cached()` once the
    forward has filled the cache, then `append(next_ids)`. A prefill of rows that repeat gives
    each distinct row once (`Step.groups`).

    Args:
        rows: the prompts' ids, each at most `context_length` long.
        max_new_tokens: the steps to come (the buffer's size).
        context_length: the model's.
        device: the model's.
        cache: a KV cache for the batch, empty; None (`exact` once the window slides): every
            step recomputes the window.
        keep: the `shift` policy's tokens kept past the context; None: the `exact` policy.
        share_prefill: a prefill gives each distinct row once where rows repeat; False: every
            row.
    """

    def __init__(
        self,
        rows: list[list[int]],
        max_new_tokens: int,
        context_length: int,
        device: torch.device,
        *,
        cache: KVCache | None = None,
        keep: int | None = None,
        share_prefill: bool = True,
    ) -> None:
        B = len(rows)
        lengths = [len(r) for r in rows]
        P = max(lengths)
        self.context_length = context_length
        self.cache = cache
        self.keep = keep
        self.share_prefill = share_prefill
        self.pads = [P - n for n in lengths]
        self.max_pad = max(self.pads)
        capacity = P + min(max_new_tokens, 2 * context_length)
        tokens = torch.zeros(B, capacity, dtype=torch.long)  # (B, capacity)
        for b, row in enumerate(rows):
            tokens[b, self.pads[b] : P] = torch.tensor(row, dtype=torch.long)
        self.tokens = tokens.to(device)
        self.pads_t = torch.tensor(self.pads, device=device)  # (B,)
        self.end = P  # columns filled
        self._cached = 0  # columns whose keys/values are in the KV cache

    def step(self) -> Step:
        """The model's inputs for the next step, under the context policy.

        With a cache, inside the context: the whole window into the empty cache, then the
        newest column after the cached ones. `shift` with a full window first starts again from
        each row's last `keep` tokens (`keep_last`), with an empty cache. Without a cache, or
        `exact` past the context: the last `context_length` columns, recomputed.
        """
        ctx = self.context_length
        if self.keep is not None and self.end > ctx:
            self.keep_last(self.keep)
        if self.cache is None or self.end > ctx:
            return Step(*self.inputs(max(0, self.end - ctx)), None, False)
        if self._cached == 0:  # prefill the prompts
            return self.prefill()
        return Step(*self.newest_inputs(), self.cache, True)

    def prefill(self) -> Step:
        """The whole window into the empty cache: with `share_prefill`, where rows repeat (the
        same tokens after the same padding), each distinct row once, and `groups`."""
        idx, mask, input_pos = self.inputs(0)
        if self.share_prefill and idx.shape[0] > 1:
            # Padding reads -1 (no id does), whatever it holds: rows are the same exactly when
            # their padding and real tokens are.
            padding = torch.arange(self.end, device=idx.device) < self.pads_t[:, None]  # (B, T)
            key = idx.masked_fill(padding, -1).cpu()  # few ids; torch.unique(dim=0) runs here
            first, groups = (t.to(idx.device) for t in distinct_rows(key))  # (U,), (B,)
            if len(first) < len(groups):
                mask = None if mask is None else mask[first]  # (U, 1, T, T)
                input_pos = None if input_pos is None else input_pos[first]  # (U, T)
                return Step(idx[first], mask, input_pos, self.cache, False, groups)
        return Step(idx, mask, input_pos, self.cache, False)

    def mark_cached(self) -> None:
        """The step's columns are in the cache now (its forward ran with the cache)."""
        self._cached = self.end

    def inputs(self, start: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """`(idx, mask, input_pos)` for the columns `start .. end - 1`, as a window of its own:
        position 0 at each row's first real token, earlier columns masked (None, None without
        padding in the window: the model's causal defaults)."""
        idx = self.tokens[:, start : self.end]  # (B, W)
        if self.max_pad <= start:
            return idx, None, None
        W = self.end - start
        pads = (self.pads_t - start).clamp(min=0)  # (B,) padding columns in the window
        return idx, padded_mask(pads, W, W), padded_positions(pads, W, W)

    def newest_inputs(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """`(idx (B, 1), mask, input_pos)` of column `end - 1` after the cached columns before
        it (None, None without padding)."""
        idx = self.tokens.narrow(1, self.end - 1, 1)  # (B, 1)
        if self.max_pad == 0:
            return idx, None, None
        pads = self.pads_t
        return idx, padded_mask(pads, 1, self.end), padded_positions(pads, 1, self.end)

    def keep_last(self, keep: int) -> None:
        """Start the window again from each row's last tokens, as `shift` does when it is full,
        with an empty cache.

        A row with more real tokens than `context_length` (it would shift alone now) keeps its
        last `keep`; a shorter row keeps all of its own, as it would alone. The kept tokens are
        right-aligned at the new `end`; columns before a row's kept tokens count as padding from
        then on, so the kept ones take positions `0 ..` again.
        """
        ctx = self.context_length
        kept = [keep if self.end - p > ctx else self.end - p for p in self.pads]
        W = max(kept)
        self.tokens[:, :W] = self.tokens[:, self.end - W : self.end].clone()
        self.pads = [W - k for k in kept]
        self.max_pad = max(self.pads)
        self.pads_t = torch.tensor(self.pads, device=self.tokens.device)
        self.end = W
        self._cached = 0
        if self.cache is not None:
            self.cache.reset()

    def append(self, next_ids: Tensor) -> None:
        """Write the step's new tokens `(B,)` after column `end - 1`."""
        if self.end == self.tokens.shape[1]:
            # Full: keep the last context_length columns (here end > context_length, so the
            # cache is no longer in use and nothing older can be seen again).
            shift = self.end - self.context_length
            self.tokens[:, : self.context_length] = self.tokens[:, shift:].clone()
            self.pads = [max(0, p - shift) for p in self.pads]
            self.max_pad = max(self.pads)
            self.pads_t = (self.pads_t - shift).clamp(min=0)
            self.end = self.context_length
        self.tokens.select(1, self.end).copy_(next_ids)  # (B,)
        self.end += 1


def distinct_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """The distinct rows of `rows` `(B, T)`: `first` `(U,)` long, the first index of each, and
    `groups` `(B,)` long, which of them each row is (`rows[first][groups]` equals `rows`)."""
    distinct, groups = torch.unique(rows, dim=0, return_inverse=True)  # (U, T), (B,)
    B, U = rows.shape[0], distinct.shape[0]
    index = torch.arange(B, device=rows.device)  # (B,)
    first = index.new_zeros(U).scatter_reduce(0, groups, index, "amin", include_self=False)
    return first, groups  # (U,), (B,)


# ----------------------------------------------------------------------------- left padding


def padded_mask(pads: Tensor, T: int, T_k: int) -> Tensor:
    """The attention mask of `T` new columns after `T_k - T` earlier ones, in left-padded rows.

    Args:
        pads: `(B,)` long, each row's padding columns (counted from column 0 of the keys).
        T, T_k: new columns (queries) and all columns (keys).

    Returns:
        `(B, 1, T, T_k)` bool, True = may attend: causal, no padding key, a padding query on
        itself.
    """
    cols = torch.arange(T_k, device=pads.device)  # (T_k,)
    real_keys = cols[None, :] >= pads[:, None]  # (B, T_k)
    causal = causal_mask(T, T_k, pads.device)  # (T, T_k)
    itself = cols[None, :] == cols[T_k - T :, None]  # (T, T_k): each query's own column
    mask = causal & real_keys[:, None, :] | itself  # (B, T, T_k)
    return mask[:, None]  # (B, 1, T, T_k)


def padded_positions(pads: Tensor, T: int, T_k: int) -> Tensor:
    """`(B, T)` long positions of the last `T` of `T_k` columns: the real tokens before each one
    (padding columns get 0)."""
    cols = torch.arange(T_k - T, T_k, device=pads.device)  # (T,)
    return (cols[None, :] - pads[:, None]).clamp(min=0)  # (B, T)
