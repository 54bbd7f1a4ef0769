"""Attention masks, attention computed under them, the checks of attention inputs, and the
positions that skip padding.

A `key_padding_mask` is `(B, T_k)` bool with `True` = "this key is padding, ignore it", the
convention of `torch.nn.MultiheadAttention`. (SDPA's bool `attn_mask` means the opposite, `True` =
"may attend"; the conversion happens in one place, `allowed_keys`.) A query whose keys are all
masked (a left-padding position under the causal mask) gets all-zero attention weights and a zero
attention output: it never produces NaN and passes no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from llmcli.errors import InputError


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


# Attention three ways, picked by `MultiHeadAttention.forward`: q `(B, nh, T, hs)`, k and v
# `(B, nh, T_k, hs)`, the causal mask `(T, T_k)` (True = may attend), dropout probability ->
# y `(B, nh, T, hs)`. A query whose keys are all padding gets a zero output.


def explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: Tensor,
    key_padding_mask: Tensor | None,
    dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """The per-head formula written out, `softmax(Q K^T / sqrt(hs)) @ V`; also returns the weights.

    Shape:
        y `(B, nh, T, hs)`, weights `(B, nh, T, T_k)` (all zero on a query with no key).
    """
    allowed, empty_rows = allowed_keys(causal, key_padding_mask)
    hs = q.shape[-1]
    wei = q @ k.transpose(-2, -1) * hs**-0.5  # (B,nh,T,hs) @ (B,nh,hs,T_k) -> (B,nh,T,T_k)
    wei = wei.masked_fill(~allowed, float("-inf"))  # (B, nh, T, T_k)
    wei = F.softmax(wei, dim=-1)  # (B, nh, T, T_k)
    if empty_rows is not None:
        wei = wei.masked_fill(empty_rows, 0.0)
    if dropout_p > 0.0:
        wei = F.dropout(wei, dropout_p)
    y = wei @ v  # (B, nh, T, T_k) @ (B, nh, T_k, hs) -> (B, nh, T, hs)
    return y, wei


def causal_attention(q: Tensor, k: Tensor, v: Tensor, causal: Tensor, dropout_p: float) -> Tensor:
    """Fused SDPA without padding, with no mask tensor in the common cases.

    `T == T_k` (training, or a prefill into an empty cache) uses SDPA's own causal mask; one new
    token (`T == 1`, a decode step) sees every cached key; only several new tokens after cached
    ones need the sliced `causal` mask.
    """
    T, T_k = causal.shape
    if T == T_k:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if T == 1:  # one new token sees every cached key
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, dropout_p=dropout_p)


def padded_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: Tensor, key_padding_mask: Tensor, dropout_p: float
) -> Tensor:
    """Fused SDPA with the causal and padding masks combined; queries with no key output zeros."""
    allowed, empty_rows = allowed_keys(causal, key_padding_mask)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)
    return y.masked_fill(empty_rows, 0.0)  # (B, nh, T, hs)
