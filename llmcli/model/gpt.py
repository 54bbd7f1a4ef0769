"""The GPT-style causal language model: Head -> MultiHeadAttention -> MLP -> Block -> Transformer.

Shapes: `B` batch, `T` time (<= `context_length`), `C` channels (`n_embed`), `nh` heads, `hs`
head size (`C // nh`), `V` vocabulary; `T_k` keys (`past + T` with a KV cache holding `past`).

Every module is built from a `ModelConfig` (`Block(config)`), which checked itself when it was
made; keyword arguments build one (`MultiHeadAttention(n_head=4, n_embed=32, context_length=8)`).
Recipe options, all off by default (the default model is GPT-2's): rotary positions, RMSNorm and
QK-norm (`llmcli.model.layers`), a ReLU² MLP, an untied LM head.

A forward is the maths on `(B, T, C)`. What a caller builds goes in beside it: an attention
`mask` (bool, True = may attend; default causal), the positions `input_pos` of the new tokens
(default `past .. past + T - 1`) and a `KVCache` (`llmcli.model.kv_cache`); generation builds
them for left-padded batches (`llmcli.generation.engine`). Hook points (`llmcli.model.hooks`,
shapes where they are made) name what a reader may see or change: `Transformer.hook_names()`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import AbstractContextManager
from itertools import islice
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmcli.config import ModelConfig
from llmcli.errors import InputError
from llmcli.model.hooks import HookFn, HookPoint, hook_names, hooked
from llmcli.model.kv_cache import KVCache
from llmcli.model.layers import RotaryEmbedding, make_norm, qk_rms_norm, rotate


def model_config(config: ModelConfig | None, overrides: Mapping[str, Any]) -> ModelConfig:
    """The config a module is built from: `config`, or one that keyword arguments build (the
    other settings keep `ModelConfig`'s defaults; it checks them as it is made)."""
    if config is None:
        return ModelConfig(**overrides)
    if overrides:
        raise TypeError(f"give a ModelConfig or keyword arguments, not both: {sorted(overrides)}")
    return config


def causal_mask(T: int, T_k: int, device: torch.device | str | None = None) -> Tensor:
    """`(T, T_k)` bool, True where query i (at position `T_k - T + i`) may attend key j."""
    return torch.ones(T, T_k, dtype=torch.bool, device=device).tril(T_k - T)


def check_length(T: int, context_length: int) -> None:
    """Raise `InputError` (a `ValueError`) when one call holds more than `context_length`
    positions: a layer alone keeps the model's contract, `T <= context_length`, rather than
    computing an answer for lengths the model was never trained on. With a KV cache `T` counts
    the new tokens; the cache's own room is the cache's to check."""
    if T > context_length:
        raise InputError(
            f"input has {T} positions but context_length is {context_length}: give at most "
            f"{context_length}"
        )


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None) -> Tensor:
    """`softmax(Q K^T / sqrt(hs))` under `mask` (None: causal), written out: what
    `F.scaled_dot_product_attention` computes before its `@ V`, for the same masks (bool, True =
    may attend; or float, added to the scores).

    Shape:
        q `(..., T, hs)`, k `(..., T_k, hs)`, mask `(T, T_k)` or `(B, 1, T, T_k)` ->
        `(..., T, T_k)`; every query must be allowed at least one key.
    """
    T, T_k, hs = q.shape[-2], k.shape[-2], q.shape[-1]
    mask = causal_mask(T, T_k, q.device) if mask is None else mask
    wei = q @ k.transpose(-2, -1) * hs**-0.5  # (..., T, hs) @ (..., hs, T_k) -> (..., T, T_k)
    if mask.dtype.is_floating_point:
        wei = wei + mask  # (..., T, T_k)
    else:
        wei = wei.masked_fill(~mask, float("-inf"))  # (..., T, T_k)
    return F.softmax(wei, dim=-1)  # (..., T, T_k)


class Head(nn.Module):
    """One head of causal self-attention: the per-head formula, written out literally.

    `softmax(Q K^T / sqrt(hs)) V` under the causal mask, dropout on the weights, where `Q, K, V`
    are linear projections `C -> hs`, `hs = n_embed // n_head`. With `rope` / `qk_norm` the
    queries and keys are rotated / normalised first, as in `MultiHeadAttention`. A reference for
    the fused layer (`llmcli.model.heads.split_heads`), so it takes no KV cache.

    Shape:
        x `(B, T, C)`, mask `(T, T)` or `(B, 1, T, T)` bool (default causal) -> `(B, T, hs)`,
        `T <= context_length` (`InputError` otherwise).
    """

    def __init__(self, config: ModelConfig | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.config = config = model_config(config, kwargs)
        C, hs = config.n_embed, config.head_size
        self.key = nn.Linear(C, hs, bias=config.bias)
        self.query = nn.Linear(C, hs, bias=config.bias)
        self.value = nn.Linear(C, hs, bias=config.bias)
        self.dropout = nn.Dropout(config.attention_dropout)  # on the attention weights
        self.rotary = RotaryEmbedding(config) if config.pos_emb == "rope" else None

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        B, T, C = x.shape
        check_length(T, self.config.context_length)
        k = self.key(x)  # (B, T, hs)
        q = self.query(x)  # (B, T, hs)
        if self.config.qk_norm:
            q, k = qk_rms_norm(q), qk_rms_norm(k)
        if self.rotary is not None:
            rotation = self.rotary.angles(T)
            q, k = rotate(q, rotation), rotate(k, rotation)
        hs = k.shape[-1]
        wei = q @ k.transpose(-2, -1) * hs**-0.5  # (B, T, hs) @ (B, hs, T) -> (B, T, T)
        allowed = causal_mask(T, T, x.device) if mask is None else mask  # (T, T) or (B,1,T,T)
        if allowed.ndim == 4:
            allowed = allowed[:, 0]  # (B, T, T)
        wei = wei.masked_fill(~allowed, float("-inf"))  # (B, T, T)
        wei = F.softmax(wei, dim=-1)  # (B, T, T)
        wei = self.dropout(wei)
        v = self.value(x)  # (B, T, hs)
        return wei @ v  # (B, T, T) @ (B, T, hs) -> (B, T, hs)


class MultiHeadAttention(nn.Module):
    """`n_head` causal attention heads in parallel, concatenated, then projected by `proj`.

    Mathematically `proj(cat([head(x) for head in heads], dim=-1))` for `Head`s with the same
    weights (`llmcli.model.heads` converts between the two); computed fused: one QKV projection
    `qkv` (`C -> 3C`, queries then keys then values, head-major inside each, the layout of
    `torch.nn.MultiheadAttention.in_proj_weight` and GPT-2's `c_attn`) and SDPA. While a function
    is at the `pattern` hook point the weights are computed explicitly, for it to read or replace.

    Args:
        config: the model's config (`n_head`, `n_embed`, `context_length`, `dropout`, `bias`,
            `pos_emb`, `rope_base`, `qk_norm`); or keyword arguments that build one.
        layer_idx: this layer's index in a KV cache.
    """

    def __init__(
        self, config: ModelConfig | None = None, layer_idx: int = 0, **kwargs: Any
    ) -> None:
        super().__init__()
        self.config = config = model_config(config, kwargs)
        self.layer_idx = layer_idx
        self.n_head, self.head_size = config.n_head, config.head_size
        self.context_length = config.context_length
        self.dropout, self.attn_dropout = config.dropout, config.attention_dropout
        self.qk_norm = config.qk_norm
        self.qkv = nn.Linear(config.n_embed, 3 * config.n_embed, bias=config.bias)
        self.proj = nn.Linear(config.n_embed, config.n_embed, bias=config.bias)
        self.rotary = RotaryEmbedding(config) if config.pos_emb == "rope" else None
        self.pattern = HookPoint()  # (B, nh, T, T_k): the softmax weights
        self.z = HookPoint()  # (B, T, nh, hs): each head's output, before `proj`

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        input_pos: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """Attend over `x`, and over the keys a `kv_cache` holds.

        Args:
            x: `(B, T, C)`, `T <= context_length` (`InputError` otherwise); with a cache, `T`
                counts the new tokens only.
            mask: bool, True = may attend: `(T, T_k)` or `(B, 1, T, T_k)`; None for causal
                attention (the new tokens see every cached key and the new ones up to their own).
            input_pos: `(T,)` or `(B, T)` long positions of the new tokens, for rotary
                embeddings; None for `past .. past + T - 1`.
            kv_cache: where the new keys and values go, at positions `past .. past + T - 1`;
                the caller counts them once every layer has written (`KVCache.advance`), as
                `Transformer.forward` does.

        Returns:
            `(B, T, C)`.
        """
        B, T, C = x.shape
        check_length(T, self.context_length)
        nh, hs = self.n_head, self.head_size
        # view + unbind + transpose (not a 5-D permute): SDPA's backward hands back gradients
        # whose memory is (B, T, nh, hs), so the backward of this is one stack, no extra copy.
        q, k, v = self.qkv(x).view(B, T, 3, nh, hs).unbind(2)  # each (B, T, nh, hs)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # each (B, nh, T, hs)
        if self.qk_norm:
            q, k = qk_rms_norm(q), qk_rms_norm(k)
        if self.rotary is not None:
            past = 0 if kv_cache is None else kv_cache.length
            rotation = self.rotary.angles(T, input_pos, past)
            q, k = rotate(q, rotation), rotate(k, rotation)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # each (B, nh, T_k, hs)
        T_k = k.shape[2]
        if mask is None and 1 < T < T_k:  # new tokens after cached ones: SDPA's is_causal
            mask = causal_mask(T, T_k, x.device)  # aligns to the top left, this to the end
        dropout_p = self.attn_dropout if self.training else 0.0
        if self.pattern.active:  # read or replaced by a caller: computed explicitly
            wei = self.pattern(attention_weights(q, k, mask))  # (B, nh, T, T_k)
            if dropout_p > 0.0:
                wei = F.dropout(wei, dropout_p)
            y = wei @ v  # (B, nh, T, T_k) @ (B, nh, T_k, hs) -> (B, nh, T, hs)
        else:
            is_causal = mask is None and T > 1
            y = F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal)  # (B,nh,T,hs)
        y = self.z(y.transpose(1, 2))  # (B, T, nh, hs)
        y = self.proj(y.reshape(B, T, C))  # (B, T, C)
        if self.training and self.dropout > 0.0:
            y = F.dropout(y, self.dropout)
        return y


class MLP(nn.Module):
    """The position-wise feed-forward network: `C -> 4C -> activation -> C`, then dropout.

    The activation is `config.mlp`: "gelu" (exact erf GELU, as GPT-2's
    `activation_function="gelu"`; faster than the tanh approximation on CPU) or "relu2"
    (`relu(x)**2`, So et al. 2021 "Primer").

    Shape:
        `(B, T, C)` -> `(B, T, C)`
    """

    def __init__(self, config: ModelConfig | None = None, **kwargs: Any) -> None:
        super().__init__()
        config = model_config(config, kwargs)
        self.activation = config.mlp
        self.dropout = config.dropout
        self.fc = nn.Linear(config.n_embed, 4 * config.n_embed, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embed, config.n_embed, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)  # (B, T, 4C)
        h = F.gelu(h) if self.activation == "gelu" else F.relu(h).square()  # (B, T, 4C)
        y = self.proj(h)  # (B, T, C)
        if self.training and self.dropout > 0.0:
            y = F.dropout(y, self.dropout)
        return y


class Block(nn.Module):
    """A pre-norm Transformer block: `x = x + attn(ln1(x)); x = x + mlp(ln2(x))`.

    Args:
        config: the model's config (see `MultiHeadAttention`, `MLP`; `norm` for `ln1`, `ln2`), or
            keyword arguments that build one.
        layer_idx: this block's index in a KV cache.

    Shape:
        `(B, T, C)` -> `(B, T, C)`
    """

    def __init__(
        self, config: ModelConfig | None = None, layer_idx: int = 0, **kwargs: Any
    ) -> None:
        super().__init__()
        config = model_config(config, kwargs)
        # Registered in the order of the forward, which `hook_names` lists them in.
        self.resid_pre = HookPoint()  # (B, T, C): the block's input
        self.ln1 = make_norm(config)
        self.attn_in = HookPoint()  # (B, T, C): ln1's output, what the attention reads
        self.attn = MultiHeadAttention(config, layer_idx)
        self.attn_out = HookPoint()  # (B, T, C)
        self.resid_mid = HookPoint()  # (B, T, C): after the attention's residual add
        self.ln2 = make_norm(config)
        self.mlp_in = HookPoint()  # (B, T, C): ln2's output, what the MLP (a transcoder) reads
        self.mlp = MLP(config)
        self.mlp_out = HookPoint()  # (B, T, C)
        self.resid_post = HookPoint()  # (B, T, C): the block's output

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        input_pos: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """See `MultiHeadAttention.forward` (which refuses `T > context_length`):
        `(B, T, C)` -> `(B, T, C)`."""
        x = self.resid_pre(x)
        attn = self.attn(self.attn_in(self.ln1(x)), mask, input_pos, kv_cache)  # (B, T, C)
        x = self.resid_mid(x + self.attn_out(attn))  # (B, T, C)
        x = self.resid_post(x + self.mlp_out(self.mlp(self.mlp_in(self.ln2(x)))))  # (B, T, C)
        return x


class Transformer(nn.Module):
    """A GPT-style causal language model.

    Token embeddings (+ learned position embeddings unless `pos_emb="rope"`), `n_layer` Blocks,
    a final norm and a linear LM head (tied to the token embedding by default). GPT-2 init:
    normal(0, 0.02) weights, zero biases, residual projections (`attn.proj`, `mlp.proj`) scaled
    by `1/sqrt(2 n_layer)`.

    Args:
        config: the model's shape and recipe options.
        vocab_size: `V`.
        generator: random generator for the initial weights (default: torch's global one).
    """

    def __init__(
        self, config: ModelConfig, vocab_size: int, *, generator: torch.Generator | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.vocab_size, self.dropout = vocab_size, config.dropout
        # The config's sizes, which readers of a model ask for often.
        self.n_layer, self.n_head, self.n_embed = config.n_layer, config.n_head, config.n_embed
        self.context_length, self.tie_embeddings = config.context_length, config.tie_embeddings
        C = config.n_embed
        self.wte = nn.Embedding(vocab_size, C)
        self.wpe = nn.Embedding(config.context_length, C) if config.pos_emb == "learned" else None
        self.embed = HookPoint()  # (B, T, C): token (+ position) embeddings
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = make_norm(config)
        self.final_norm = HookPoint()  # (B, T, C): after ln_f
        self.lm_head = nn.Linear(C, vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # one tensor, used twice
        self._init_weights(generator)

    def _init_weights(self, generator: torch.Generator | None) -> None:
        std = 0.02
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    if module is self.lm_head and self.tie_embeddings:
                        continue  # it is the token embedding, initialised once
                    nn.init.normal_(module.weight, mean=0.0, std=std, generator=generator)
                    if getattr(module, "bias", None) is not None:
                        nn.init.zeros_(module.bias)
            # GPT-2: scale the projections that write into the residual stream, whose
            # contributions add up over 2 * n_layer sublayers.
            residual_std = std / math.sqrt(2 * self.n_layer)
            for block in self.blocks:
                for linear in (block.attn.proj, block.mlp.proj):
                    nn.init.normal_(linear.weight, mean=0.0, std=residual_std, generator=generator)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Number of parameters (a tied weight counts once).

        With `non_embedding`, position embeddings are left out, and so is the token embedding when
        untied (a lookup table costs no compute); a tied one stays, as it is the LM head's weight.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if self.wpe is not None:
                n -= self.wpe.weight.numel()
            if not self.tie_embeddings:
                n -= self.wte.weight.numel()
        return n

    def new_kv_cache(
        self,
        batch_size: int,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """An empty `KVCache` for this model: `max_len` positions (default `context_length`), on
        the model's device and in its dtype unless given."""
        max_len = self.context_length if max_len is None else max_len
        if not 0 < max_len <= self.context_length:
            raise InputError(
                f"KV cache max_len must be in 1..context_length ({self.context_length}), "
                f"got {max_len}"
            )
        weight = self.wte.weight
        return KVCache(
            self.n_layer,
            batch_size,
            self.n_head,
            self.config.head_size,
            max_len,
            device=weight.device if device is None else device,
            dtype=weight.dtype if dtype is None else dtype,
        )

    def hook_names(self) -> list[str]:
        """Every hook point, in the order the forward meets them (see the module doc)."""
        return hook_names(self)

    def hooks(self, fns: Mapping[str, HookFn | list[HookFn]]) -> AbstractContextManager[None]:
        """`with model.hooks({name: fn}):` runs `fn(activation)` at each named hook point; a
        returned tensor replaces the activation (see `llmcli.model.hooks`)."""
        return hooked(self, fns)

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        input_pos: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Next-token logits, and the mean cross-entropy when `targets` are given.

        Args:
            idx: `(B, T)` long token ids.
            targets: `(B, T)` long next-token ids; `-1` marks positions left out of the loss.
            mask: attention mask, `(T, T_k)` or `(B, 1, T, T_k)` with `T_k = past + T`: bool,
                True = may attend (or float, added to the scores, as SDPA takes it); every
                query must be allowed at least one key. None: causal.
            input_pos: `(T,)` or `(B, T)` long positions of the new tokens (< `context_length`);
                None: `past .. past + T - 1`.
            kv_cache: from `new_kv_cache`; the new tokens' keys and values are appended after
                the `past` it holds, and attention runs over all of them.

        Returns:
            `(logits (B, T, V), loss)`; `loss` is None without `targets`.
        """
        B, T = idx.shape
        past = 0 if kv_cache is None else kv_cache.length
        if past + T > self.context_length:
            cached = f" after {past} cached positions" if past else ""
            raise InputError(
                f"input has T = {T} positions{cached} but the model's context_length is "
                f"{self.context_length}: crop the input to its last "
                f"{self.context_length - past} tokens"
            )
        if kv_cache is not None:
            kv_cache.check_room(B, T)  # before any layer writes
        x = self.embedding(idx, input_pos, past)  # (B, T, C)
        for block in self.blocks:
            x = block(x, mask, input_pos, kv_cache)  # (B, T, C)
        logits = self.to_logits(x)  # (B, T, V)
        if kv_cache is not None:
            kv_cache.advance(T)  # every layer has written its new keys and values
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        return logits, loss

    def embedding(self, idx: Tensor, input_pos: Tensor | None = None, past: int = 0) -> Tensor:
        """Token embeddings, plus learned position embeddings (none with rope), then dropout.

        Shape:
            idx `(B, T)` long -> `(B, T, C)`; positions `input_pos`, else `past .. past + T - 1`.
        """
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            if input_pos is None:
                # A slice costs a copy in backward; the whole table (the usual training case) not.
                wpe, T = self.wpe.weight, idx.shape[1]
                pos = wpe if past == 0 and T == wpe.shape[0] else wpe[past : past + T]  # (T, C)
                x = x + pos  # (B, T, C) + (T, C)
            else:
                x = x + self.wpe(input_pos)  # (B, T, C)
        x = self.embed(x)
        if self.training and self.dropout > 0.0:
            x = F.dropout(x, self.dropout)
        return x

    def run_blocks(self, x: Tensor, start: int = 0) -> Tensor:
        """Blocks `start`.. on the residual stream `x` `(B, T, C)`, causally: a forward from the
        middle, for callers that change one layer's input and run the rest."""
        for block in islice(self.blocks, start, None):
            x = block(x)  # (B, T, C)
        return x

    def to_logits(self, x: Tensor) -> Tensor:
        """The last block's output to logits: final norm, LM head. `(B, T, C)` -> `(B, T, V)`."""
        return self.lm_head(self.final_norm(self.ln_f(x)))
