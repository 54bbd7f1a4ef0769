"""How a query attends: the context every attention layer of one forward shares, and attention
computed under it, fused (`attend`) or with its weights written out (`attention_weights`).

`AttentionContext.build` turns what a forward is given (a key padding mask, positions, a KV
cache) into what its layers need, once per forward: the positions already cached, each token's
position, and the mask of the keys each query may see. A `key_padding_mask` is `(B, T_k)` bool with
`True` = "this key is padding, ignore it", the convention of `torch.nn.MultiheadAttention`
(SDPA's bool `attn_mask` means the opposite, `True` = "may attend"; the conversion happens in one
place, `allowed_keys`). A query whose keys are all masked (a left-padding position under the
causal mask) gets all-zero attention weights and a zero output: never NaN, and no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from llmcli.errors import InputError
from llmcli.model.kv_cache import KVCache


@dataclass
class AttentionContext:
    """What every attention layer of one forward needs besides its input.

    Attributes:
        past: positions already in `cache` before this forward (0 without one).
        position_ids: `(B, T)` long positions of the new tokens, or None for `past .. past+T-1`.
        cache: the KV cache the layers append to and attend over, or None.
        mask: `(T, T_k)` or, with padding, `(B, 1, T, T_k)` bool, True = may attend
            (`T_k = past + T`); None when the causal mask is all there is and SDPA applies it
            itself (`T == T_k`), or there is nothing to mask (one new token sees every key).
        empty_rows: `(B, 1, T, 1)` bool, the queries with no key to attend (their output is
            zero), or None.
        decode: a decode step (`decode_step`): one new token per row, whose activations the
            attention layers may take as `(B, C)`, without the time dimension.
    """

    past: int = 0
    position_ids: Tensor | None = None
    cache: KVCache | None = None
    mask: Tensor | None = None
    empty_rows: Tensor | None = None
    decode: bool = False

    @classmethod
    def build(
        cls,
        idx: Tensor,
        context_length: int,
        *,
        key_padding_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> AttentionContext:
        """Check a forward's inputs and derive its context (see `Transformer.forward`).

        Args:
            idx: `(B, T)` token ids or `(B, T, C)` activations: only the batch size, the length
                and the device are read.
            context_length: the model's longest sequence.
            key_padding_mask: bool, True = padding; `(B, T)`, or with a cache `(B, past + T)`
                (the cache remembers the padding of earlier calls, see `padding_with_cache`).
            position_ids: `(B, T)` long; default: past the padding (see `default_position_ids`).
            kv_cache: the cache to append to, checked for room before any layer writes.

        Raises:
            InputError: too long an input, a mask or positions of the wrong type or shape, a
                cache without room.
        """
        B, T = idx.shape[0], idx.shape[1]
        past = 0
        if kv_cache is not None:
            past = kv_cache.length
            kv_cache.check_fits(B, T)  # before any layer writes: a failed call changes nothing
        check_length(T, context_length, past)
        key_padding_mask = padding_with_cache(key_padding_mask, kv_cache, B, past, T)
        position_ids = default_position_ids(position_ids, key_padding_mask, B, past, T)
        mask = empty_rows = None
        if key_padding_mask is not None or 1 < T < past + T:
            mask = causal_mask(T, past + T, idx.device)
            mask, empty_rows = allowed_keys(mask, key_padding_mask)
        return cls(past, position_ids, kv_cache, mask, empty_rows)

    @classmethod
    def decode_step(cls, cache: KVCache, position_ids: Tensor | None = None) -> AttentionContext:
        """The context of one new token per row after the cached positions (a decode step),
        from inputs that generation made: `build` without its checks. The new tokens are real,
        so no query is left without a key; the cache's padding, if any, is masked.

        Args:
            cache: the generation's cache.
            position_ids: `(B, 1)` long positions of the new tokens, or None for the cache length.
        """
        past = cache.length
        padding = padding_with_cache(None, cache, cache.batch_size, past, 1)  # (B, past+1) or None
        if padding is None:
            return cls(past, position_ids, cache, decode=True)
        mask = allowed_keys(causal_mask(1, past + 1, padding.device), padding)[0]  # (B,1,1,past+1)
        return cls(past, position_ids, cache, mask, decode=True)


def causal_mask(T: int, T_k: int, device: torch.device | str | None = None) -> Tensor:
    """`(T, T_k)` bool, True where query i (at position `T_k - T + i`) may attend key j."""
    return torch.ones(T, T_k, dtype=torch.bool, device=device).tril(T_k - T)


def allowed_keys(causal: Tensor, key_padding_mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Combine the causal mask with a key padding mask, in SDPA's convention (True = attend).

    Args:
        causal: `(T_q, T_k)` bool, True where query i may attend key j.
        key_padding_mask: `(B, T_k)` bool, True = padding (ignored), or None.

    Returns:
        `(allowed, empty_rows)`. Without padding: `(causal, None)`. With padding: `allowed` is
        `(B, 1, T_q, T_k)`, and `empty_rows` `(B, 1, T_q, 1)` marks queries that have no key left.
        Those rows are opened to every key in `allowed` so that the softmax stays finite; the
        caller zeroes their weights or outputs with `empty_rows`.
    """
    if key_padding_mask is None:
        return causal, None
    allowed = causal & ~key_padding_mask[:, None, None, :]  # (B, 1, T_q, T_k)
    empty_rows = ~allowed.any(dim=-1, keepdim=True)  # (B, 1, T_q, 1)
    return allowed | empty_rows, empty_rows


# Attention two ways: q `(B, nh, T, hs)`, k and v `(B, nh, T_k, hs)`, under a context's mask.


def attend(q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, dropout_p: float) -> Tensor:
    """`softmax(Q K^T / sqrt(hs)) V` under the context's mask, fused (SDPA).

    Shape:
        -> `(B, nh, T, hs)`; a query with no key outputs zeros.
    """
    if ctx.mask is None:  # causal with T == T_k (SDPA's own mask), or one query seeing every key
        # (attn_mask, dropout_p, is_causal) by position: parsing keywords shows on a decode step.
        return F.scaled_dot_product_attention(q, k, v, None, dropout_p, q.shape[2] > 1)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask, dropout_p=dropout_p)
    return y if ctx.empty_rows is None else y.masked_fill(ctx.empty_rows, 0.0)  # (B, nh, T, hs)


def attention_weights(q: Tensor, k: Tensor, ctx: AttentionContext) -> Tensor:
    """The attention weights written out: `softmax(Q K^T / sqrt(hs))` under the context's mask.

    Shape:
        -> `(B, nh, T, T_k)`; rows sum to 1, but a query with no key has all-zero weights.
    """
    T, T_k, hs = q.shape[-2], k.shape[-2], q.shape[-1]
    mask = causal_mask(T, T_k, q.device) if ctx.mask is None else ctx.mask
    wei = q @ k.transpose(-2, -1) * hs**-0.5  # (B,nh,T,hs) @ (B,nh,hs,T_k) -> (B,nh,T,T_k)
    wei = wei.masked_fill(~mask, float("-inf"))  # (B, nh, T, T_k)
    wei = F.softmax(wei, dim=-1)  # (B, nh, T, T_k)
    if ctx.empty_rows is not None:
        wei = wei.masked_fill(ctx.empty_rows, 0.0)  # rows with no key attend to nothing
    return wei


# The checks of a forward's inputs, and the positions and padding they imply.


def check_padding_mask(key_padding_mask: Tensor, B: int, T_k: int) -> None:
    """Raise `InputError` unless `key_padding_mask` is a `(B, T_k)` bool tensor.

    A 0/1 integer mask is refused rather than converted: Hugging Face's `attention_mask` uses
    1 = keep, the opposite of this convention, and guessing would silently invert it.
    """
    if key_padding_mask.dtype != torch.bool:
        raise InputError(
            f"key_padding_mask must be a bool tensor (True = padding, ignored), "
            f"got dtype {key_padding_mask.dtype}; for a Hugging Face style attention_mask "
            f"(1 = keep) pass `attention_mask == 0`"
        )
    if tuple(key_padding_mask.shape) != (B, T_k):
        raise InputError(
            f"key_padding_mask has shape {tuple(key_padding_mask.shape)}, expected (B, T_keys) = "
            f"({B}, {T_k})"
        )


def check_length(T: int, context_length: int, past: int = 0) -> None:
    """Raise `InputError` when `past` cached plus `T` new positions exceed `context_length`."""
    if past + T > context_length:
        cached = f" after {past} cached positions" if past else ""
        raise InputError(
            f"input has T = {T} positions{cached} but the model's context_length is "
            f"{context_length}: crop the input to its last {context_length - past} tokens"
        )


def default_position_ids(
    position_ids: Tensor | None, key_padding_mask: Tensor | None, B: int, past: int, T: int
) -> Tensor | None:
    """Check given positions, or count them past the padding when there is some.

    Padding does not use up positions: each token's position is the number of real tokens before
    it, so a left-padded prompt starts at 0 at its first real token, as if it were alone (pads
    themselves get 0).

    Args:
        position_ids: `(B, T)` long, or None.
        key_padding_mask: `(B, past + T)` bool, True = padding, or None.
        B, past, T: batch size, positions already cached, new positions.

    Returns:
        `position_ids` if given; `(B, T)` positions counted from the padding; or None without
        padding (the model then uses `past .. past + T - 1`).
    """
    if position_ids is None and key_padding_mask is not None:
        real_before = (~key_padding_mask).cumsum(dim=1) - 1  # (B, past + T)
        return real_before[:, past:].clamp(min=0)  # (B, T)
    if position_ids is not None and tuple(position_ids.shape) != (B, T):
        raise InputError(f"position_ids must have shape {(B, T)}, got {tuple(position_ids.shape)}")
    return position_ids


def padding_with_cache(
    key_padding_mask: Tensor | None, kv_cache: KVCache | None, B: int, past: int, T: int
) -> Tensor | None:
    """The key padding mask over every key of this forward, remembered by the cache.

    With a cache, the mask given to a forward may cover every key (`(B, past + T)`) or only the new
    tokens (`(B, T)`); either way it is written into `kv_cache.padding`, so that later calls
    (one-token decode steps) may pass none: their new tokens count as real.

    Args:
        key_padding_mask: bool, True = padding, or None.
        kv_cache: the cache of this forward, or None (then the mask is only checked).
        B, past, T: batch size, positions already cached, new positions.

    Returns:
        `(B, past + T)` bool (a view into the cache), or None while nothing is padding.
    """
    if kv_cache is None:
        if key_padding_mask is not None:
            check_padding_mask(key_padding_mask, B, T)
        return key_padding_mask
    if key_padding_mask is None:
        if not kv_cache.has_padding:
            return None
        kv_cache.padding[:, past : past + T] = False  # new tokens are real
    else:
        if key_padding_mask.dtype == torch.bool and key_padding_mask.shape[-1] == T:
            check_padding_mask(key_padding_mask, B, T)
            kv_cache.padding[:, past : past + T] = key_padding_mask
        else:
            check_padding_mask(key_padding_mask, B, past + T)
            kv_cache.padding[:, : past + T] = key_padding_mask
        kv_cache.has_padding = True
    return kv_cache.padding[:, : past + T]  # (B, past + T)
