"""The GPT-style causal language model: Head -> MultiHeadAttention -> MLP -> Block -> Transformer.

Shapes: `B` batch, `T` time (<= `context_length`), `C` channels (`n_embed`), `nh` heads, `hs`
head size (`C // nh`), `V` vocabulary. `Head` is a single attention head written out literally;
`MultiHeadAttention` computes `nh` such heads at once (one fused QKV projection,
`F.scaled_dot_product_attention`) and equals a stack of `Head`s with the same weights.

Recipe options (all off by default, so the default model is a GPT-2-like architecture): rotary
position embeddings (`rope`), RMSNorm, QK-norm (their layers are in `llmcli.model.layers`), a ReLU²
MLP and an untied LM head. Masks, and attention computed under them three ways (the explicit
formula, fused SDPA, fused SDPA with padding), are in `llmcli.model.masks`; generation uses
`llmcli.model.kv_cache.KVCache`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmcli.errors import InputError
from llmcli.model.kv_cache import KVCache, padding_with_cache
from llmcli.model.layers import RotaryEmbedding, make_norm, mask_heads, qk_rms_norm
from llmcli.model.masks import (
    allowed_keys,
    causal_attention,
    check_length,
    check_padding_mask,
    default_position_ids,
    explicit_attention,
    padded_attention,
)

if TYPE_CHECKING:
    from llmcli.config import ModelConfig

MLPS = ("gelu", "relu2")
POS_EMBS = ("learned", "rope")


class Head(nn.Module):
    """One head of causal self-attention: the per-head formula, written out literally.

    `softmax(Q K^T / sqrt(hs))` with the causal mask, dropout on the weights, then `@ V`, where
    `Q, K, V` are linear projections `C -> hs`. With `rope` / `qk_norm` the queries and keys are
    rotated / normalised first, as in `MultiHeadAttention`.

    Args:
        n_embed: input channels `C`.
        head_size: `hs`.
        context_length: longest sequence (size of the causal mask).
        dropout: dropout probability on the attention weights.
        bias: whether the key/query/value projections have a bias (none by default).
        rope: rotate queries and keys by their positions (rotary embeddings).
        rope_base: rotary frequency base.
        qk_norm: RMS-normalise queries and keys (parameter-free).

    Shape:
        x `(B, T, C)` -> `(B, T, hs)`; `key_padding_mask` `(B, T)` bool, True = padding.
        A query whose keys are all padding outputs zeros.
    """

    def __init__(
        self,
        n_embed: int,
        head_size: int,
        context_length: int,
        dropout: float = 0.0,
        bias: bool = False,
        *,
        rope: bool = False,
        rope_base: float = 10000.0,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.key = nn.Linear(n_embed, head_size, bias=bias)
        self.query = nn.Linear(n_embed, head_size, bias=bias)
        self.value = nn.Linear(n_embed, head_size, bias=bias)
        mask = torch.tril(torch.ones(context_length, context_length, dtype=torch.bool))
        self.register_buffer("tril", mask, persistent=False)  # (L, L), True = may attend
        self.dropout = nn.Dropout(dropout)
        self.rotary = RotaryEmbedding(head_size, context_length, rope_base) if rope else None
        self.rope_base = rope_base
        self.qk_norm = qk_norm

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        B, T, C = x.shape
        check_length(T, self.tril.shape[0])
        if key_padding_mask is not None:
            check_padding_mask(key_padding_mask, B, T)
        k = self.key(x)  # (B, T, hs)
        q = self.query(x)  # (B, T, hs)
        if self.qk_norm:
            q, k = qk_rms_norm(q), qk_rms_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q, position_ids), self.rotary(k, position_ids)
        hs = k.shape[-1]
        wei = q @ k.transpose(-2, -1) * hs**-0.5  # (B, T, hs) @ (B, hs, T) -> (B, T, T)
        allowed, empty_rows = allowed_keys(self.tril[:T, :T], key_padding_mask)
        if empty_rows is not None:
            allowed, empty_rows = allowed[:, 0], empty_rows[:, 0]  # (B, T, T), (B, T, 1)
        wei = wei.masked_fill(~allowed, float("-inf"))  # (B, T, T)
        wei = F.softmax(wei, dim=-1)  # (B, T, T)
        if empty_rows is not None:
            wei = wei.masked_fill(empty_rows, 0.0)  # rows with no key attend to nothing
        wei = self.dropout(wei)
        v = self.value(x)  # (B, T, hs)
        return wei @ v  # (B, T, T) @ (B, T, hs) -> (B, T, hs)


class MultiHeadAttention(nn.Module):
    """`n_head` causal attention heads in parallel, concatenated, then projected by `proj`.

    Mathematically `proj(cat([head(x) for head in heads], dim=-1))` for `Head`s with the same
    weights (`heads()`, `from_heads`); computed fused: one QKV projection `qkv` (`C -> 3C`, queries
    then keys then values, head-major inside each, the layout of
    `torch.nn.MultiheadAttention.in_proj_weight` and GPT-2's `c_attn`) and
    `F.scaled_dot_product_attention`. `return_weights=True` takes an explicit softmax path that
    also returns the per-head attention weights.

    Args:
        n_head: number of heads `nh`; `n_embed` must be divisible by it.
        n_embed: channels `C`.
        context_length: longest sequence.
        dropout: dropout on the attention weights and on the output (residual dropout).
        bias: biases in `qkv` and `proj`.
        rope: rotary position embeddings on queries and keys.
        rope_base: rotary frequency base.
        qk_norm: parameter-free RMSNorm of queries and keys over the head dimension.

    Shape:
        x `(B, T, C)` -> `(B, T, C)`; weights `(B, nh, T, T_k)` with `T_k = past + T`.
        A query whose keys are all masked gets zero weights and a zero head output, so the
        layer returns `proj.bias` there (never NaN).
    """

    def __init__(
        self,
        n_head: int,
        n_embed: int,
        context_length: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        rope: bool = False,
        rope_base: float = 10000.0,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        if n_embed % n_head != 0:
            raise InputError(f"n_embed ({n_embed}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.n_embed = n_embed
        self.head_size = n_embed // n_head
        self.context_length = context_length
        self.dropout = dropout
        self.rope_base = rope_base
        self.qk_norm = qk_norm
        self.qkv = nn.Linear(n_embed, 3 * n_embed, bias=bias)
        self.proj = nn.Linear(n_embed, n_embed, bias=bias)
        mask = torch.tril(torch.ones(context_length, context_length, dtype=torch.bool))
        self.register_buffer("causal", mask, persistent=False)  # (L, L), True = may attend
        self.rotary = RotaryEmbedding(self.head_size, context_length, rope_base) if rope else None

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        *,
        position_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
        layer_idx: int = 0,
        return_weights: bool = False,
        head_mask: Tensor | None = None,
        head_mean: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend causally over `x` (and over the cached keys, with a `kv_cache`).

        Args:
            x: `(B, T, C)`.
            key_padding_mask: `(B, T_k)` bool, True = padding (ignored); `T_k = past + T` where
                `past` is the number of positions in `kv_cache` for this layer (0 without).
            position_ids: `(B, T)` long positions for rotary embeddings; default
                `past .. past + T - 1`. Ignored without `rope`.
            kv_cache: append this call's keys/values to layer `layer_idx` of the cache and
                attend over all of them.
            layer_idx: the layer's index in `kv_cache`.
            return_weights: use the explicit softmax path and also return the weights.
            head_mask: `(nh,)` or `(B, nh)`: 1 keeps a head, 0 removes its output before `proj`.
            head_mean: `(nh, hs)`: what a removed head outputs instead of zeros (mean ablation).

        Returns:
            `y` `(B, T, C)`, or `(y, weights)` with weights `(B, nh, T, T_k)`.
        """
        B, T, C = x.shape
        nh, hs = self.n_head, self.head_size
        past = 0 if kv_cache is None else kv_cache.layer_length(layer_idx)
        check_length(T, self.context_length, past)
        if key_padding_mask is not None:
            check_padding_mask(key_padding_mask, B, past + T)

        # split + view + transpose (not a 5-D permute): SDPA's backward hands back gradients whose
        # memory is (B, T, nh, hs), so the backward of this is one concatenation, no extra copy.
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        q = q.view(B, T, nh, hs)  # (B, T, nh, hs)
        k = k.view(B, T, nh, hs)  # (B, T, nh, hs)
        v = v.view(B, T, nh, hs)  # (B, T, nh, hs)
        if self.qk_norm:
            q, k = qk_rms_norm(q), qk_rms_norm(k)
        if self.rotary is not None:
            q = self.rotary(q, position_ids, offset=past)
            k = self.rotary(k, position_ids, offset=past)
        q = q.transpose(1, 2)  # (B, nh, T, hs)
        k = k.transpose(1, 2)  # (B, nh, T, hs)
        v = v.transpose(1, 2)  # (B, nh, T, hs)
        if kv_cache is not None:
            k, v = kv_cache.update(layer_idx, k, v)  # each (B, nh, past + T, hs)
        T_k = past + T

        # The causal mask is top-left aligned only when T == T_k; with a cache, query i sits at
        # position past + i, so the mask is the matching slice of the full lower triangle.
        causal = self.causal[past:T_k, :T_k]  # (T, T_k)
        dropout_p = self.dropout if self.training else 0.0
        if return_weights:
            y, wei = explicit_attention(q, k, v, causal, key_padding_mask, dropout_p)
        elif key_padding_mask is None:
            y = causal_attention(q, k, v, causal, dropout_p)
        else:
            y = padded_attention(q, k, v, causal, key_padding_mask, dropout_p)
        if head_mask is not None:  # head ablation; without it, this one test
            y = mask_heads(y, head_mask, head_mean)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, nh, T, hs) -> (B, T, nh, hs) -> (B, T, C)
        y = self.proj(y)  # (B, T, C)
        if dropout_p > 0.0:
            y = F.dropout(y, dropout_p)
        return (y, wei) if return_weights else y

    @classmethod
    def from_heads(cls, heads: list[Head], proj: nn.Linear) -> MultiHeadAttention:
        """Build the fused layer from a list of `Head`s and an output projection (weights copied).

        A missing bias on the heads or on `proj` becomes a zero bias, which computes the same.
        """
        if not heads:
            raise InputError("from_heads needs at least one Head")
        n_head = len(heads)
        n_embed, head_size = heads[0].key.in_features, heads[0].key.out_features
        if n_head * head_size != n_embed or proj.in_features != n_embed:
            raise InputError(
                f"from_heads needs n_head * head_size == n_embed == proj.in_features, got "
                f"{n_head} * {head_size}, {n_embed}, {proj.in_features}"
            )
        first = heads[0]
        mha = cls(
            n_head,
            n_embed,
            first.tril.shape[0],
            dropout=first.dropout.p,
            bias=any(h.key.bias is not None for h in heads) or proj.bias is not None,
            rope=first.rotary is not None,
            rope_base=first.rope_base,
            qk_norm=first.qk_norm,
        ).to(device=proj.weight.device, dtype=proj.weight.dtype)
        with torch.no_grad():
            for i, head in enumerate(heads):
                rows = slice(i * head_size, (i + 1) * head_size)
                for j, linear in enumerate((head.query, head.key, head.value)):
                    qkv_rows = slice(j * n_embed + rows.start, j * n_embed + rows.stop)
                    mha.qkv.weight[qkv_rows] = linear.weight
                    if mha.qkv.bias is not None:
                        bias = linear.bias if linear.bias is not None else 0.0
                        mha.qkv.bias[qkv_rows] = bias
            mha.proj.weight.copy_(proj.weight)
            if mha.proj.bias is not None:
                mha.proj.bias.copy_(proj.bias if proj.bias is not None else 0.0)
        if first.rotary is not None:
            # Use the heads' own tables so that the two computations agree to the last bit.
            mha.rotary.cos.copy_(first.rotary.cos)
            mha.rotary.sin.copy_(first.rotary.sin)
        return mha

    def heads(self) -> list[Head]:
        """This layer as `n_head` separate `Head` modules, holding copies of its weights.

        `self.proj(torch.cat([h(x) for h in self.heads()], dim=-1))` equals `self(x)`.
        """
        C, hs = self.n_embed, self.head_size
        has_bias = self.qkv.bias is not None
        heads = []
        for i in range(self.n_head):
            head = Head(
                C,
                hs,
                self.context_length,
                dropout=self.dropout,
                bias=has_bias,
                rope=self.rotary is not None,
                rope_base=self.rope_base,
                qk_norm=self.qk_norm,
            ).to(device=self.qkv.weight.device, dtype=self.qkv.weight.dtype)
            with torch.no_grad():
                for j, linear in enumerate((head.query, head.key, head.value)):
                    rows = slice(j * C + i * hs, j * C + (i + 1) * hs)
                    linear.weight.copy_(self.qkv.weight[rows])
                    if has_bias:
                        linear.bias.copy_(self.qkv.bias[rows])
            heads.append(head)
        return heads


class MLP(nn.Module):
    """The position-wise feed-forward network: `C -> 4C -> activation -> C`, then dropout.

    Args:
        n_embed: channels `C`.
        dropout: dropout on the output.
        bias: biases in both linear layers.
        activation: "gelu" (exact erf GELU, as GPT-2's `activation_function="gelu"`; faster than
            the tanh approximation on CPU) or "relu2" (`relu(x)**2`, So et al. 2021 "Primer").

    Shape:
        `(B, T, C)` -> `(B, T, C)`
    """

    def __init__(
        self, n_embed: int, dropout: float = 0.0, bias: bool = True, *, activation: str = "gelu"
    ) -> None:
        super().__init__()
        if activation not in MLPS:
            raise InputError(f"mlp activation must be one of {MLPS}, got {activation!r}")
        self.activation = activation
        self.dropout = dropout
        self.fc = nn.Linear(n_embed, 4 * n_embed, bias=bias)
        self.proj = nn.Linear(4 * n_embed, n_embed, bias=bias)

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
        n_head, n_embed, context_length, dropout, bias: as in `MultiHeadAttention`.
        norm: "layernorm" or "rmsnorm" for `ln1` and `ln2`.
        mlp: the MLP activation, "gelu" or "relu2".
        rope, rope_base, qk_norm: attention options, see `MultiHeadAttention`.

    Shape:
        `(B, T, C)` -> `(B, T, C)`
    """

    def __init__(
        self,
        n_head: int,
        n_embed: int,
        context_length: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        norm: str = "layernorm",
        mlp: str = "gelu",
        rope: bool = False,
        rope_base: float = 10000.0,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.ln1 = make_norm(norm, n_embed, bias)
        self.attn = MultiHeadAttention(
            n_head,
            n_embed,
            context_length,
            dropout,
            bias,
            rope=rope,
            rope_base=rope_base,
            qk_norm=qk_norm,
        )
        self.ln2 = make_norm(norm, n_embed, bias)
        self.mlp = MLP(n_embed, dropout, bias, activation=mlp)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        *,
        position_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
        layer_idx: int = 0,
        return_weights: bool = False,
        head_mask: Tensor | None = None,
        head_mean: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """See `MultiHeadAttention.forward`; returns `x` `(B, T, C)` or `(x, weights)`."""
        a = self.attn(
            self.ln1(x),
            key_padding_mask,
            position_ids=position_ids,
            kv_cache=kv_cache,
            layer_idx=layer_idx,
            return_weights=return_weights,
            head_mask=head_mask,
            head_mean=head_mean,
        )
        a, wei = a if return_weights else (a, None)
        x = x + a  # (B, T, C)
        x = x + self.mlp(self.ln2(x))  # (B, T, C)
        return (x, wei) if return_weights else x


class Transformer(nn.Module):
    """A GPT-style causal language model.

    Token embeddings (+ learned position embeddings unless `pos_emb="rope"`), `n_layer` Blocks,
    a final norm and a linear LM head (tied to the token embedding by default). GPT-2 init:
    normal(0, 0.02) weights, zero biases, residual projections (`attn.proj`, `mlp.proj`) scaled
    by `1/sqrt(2 n_layer)`.

    Args:
        vocab_size: `V`.
        n_layer, n_head, n_embed, context_length, dropout, bias: the model's shape.
        pos_emb: "learned" (GPT-2) or "rope" (rotary embeddings in every attention layer).
        norm: "layernorm" or "rmsnorm".
        qk_norm: RMS-normalise queries and keys.
        mlp: "gelu" or "relu2".
        tie_embeddings: share the LM head's weight with the token embedding.
        rope_base: rotary frequency base.
        generator: random generator for the initial weights (default: torch's global one).
    """

    def __init__(
        self,
        vocab_size: int,
        n_layer: int,
        n_head: int,
        n_embed: int,
        context_length: int,
        dropout: float = 0.0,
        bias: bool = True,
        pos_emb: str = "learned",
        norm: str = "layernorm",
        qk_norm: bool = False,
        mlp: str = "gelu",
        tie_embeddings: bool = True,
        *,
        rope_base: float = 10000.0,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if pos_emb not in POS_EMBS:
            raise InputError(f"pos_emb must be one of {POS_EMBS}, got {pos_emb!r}")
        self.vocab_size = vocab_size
        self.n_layer = n_layer
        self.n_head = n_head
        self.n_embed = n_embed
        self.context_length = context_length
        self.dropout = dropout
        self.pos_emb = pos_emb
        self.tie_embeddings = tie_embeddings

        self.wte = nn.Embedding(vocab_size, n_embed)
        self.wpe = nn.Embedding(context_length, n_embed) if pos_emb == "learned" else None
        self.blocks = nn.ModuleList(
            Block(
                n_head,
                n_embed,
                context_length,
                dropout,
                bias,
                norm=norm,
                mlp=mlp,
                rope=pos_emb == "rope",
                rope_base=rope_base,
                qk_norm=qk_norm,
            )
            for _ in range(n_layer)
        )
        self.ln_f = make_norm(norm, n_embed, bias)
        self.lm_head = nn.Linear(n_embed, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.wte.weight  # one tensor, used twice
        self._init_weights(generator)

    @classmethod
    def from_config(
        cls, model_cfg: ModelConfig, vocab_size: int, *, generator: torch.Generator | None = None
    ) -> Transformer:
        """Build the model a validated `ModelConfig` describes, for a vocabulary of `vocab_size`."""
        return cls(
            vocab_size,
            model_cfg.n_layer,
            model_cfg.n_head,
            model_cfg.n_embed,
            model_cfg.context_length,
            dropout=model_cfg.dropout,
            bias=model_cfg.bias,
            pos_emb=model_cfg.pos_emb,
            norm=model_cfg.norm,
            qk_norm=model_cfg.qk_norm,
            mlp=model_cfg.mlp,
            tie_embeddings=model_cfg.tie_embeddings,
            rope_base=model_cfg.rope_base,
            generator=generator,
        )

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
        """An empty `KVCache` for this model; see `KVCache.for_model`."""
        return KVCache.for_model(self, batch_size, max_len, device=device, dtype=dtype)

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
        head_mask: Tensor | None = None,
        head_mean: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Next-token logits, and the mean cross-entropy when `targets` are given.

        Args:
            idx: `(B, T)` long token ids.
            targets: `(B, T)` long next-token ids; `-1` marks positions left out of the loss.
            key_padding_mask: bool, True = padding; `(B, T)`, or with a `kv_cache` either
                `(B, past + T)` (every key) or `(B, T)` (the new tokens; the cache remembers the
                earlier ones). Padding positions get no attention from the other positions.
            position_ids: `(B, T)` long positions (must be < `context_length`). Default:
                with padding, the count of real tokens before each one (so a left-padded prompt
                starts at 0 at its first real token, as if it were alone); without, `past + t`.
            kv_cache: from `new_kv_cache`; the new tokens' keys/values are appended and attention
                runs over every cached position (causal among the new ones).
            head_mask: `(n_layer, nh)`, or `(n_layer, B, nh)` per batch row: 1 keeps a head, 0
                removes its output (see `MultiHeadAttention.forward`).
            head_mean: `(n_layer, nh, hs)`: removed heads output these instead of zeros.

        Returns:
            `(logits (B, T, V), loss)`; `loss` is None without `targets`.
        """
        logits, loss, _ = self._run(
            idx, targets, key_padding_mask, position_ids, kv_cache, False, head_mask, head_mean
        )
        return logits, loss

    def forward_with_attention(
        self,
        idx: Tensor,
        key_padding_mask: Tensor | None = None,
        *,
        position_ids: Tensor | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        """Logits and every layer's attention weights, through the explicit softmax path.

        Returns:
            `(logits (B, T, V), [weights (B, nh, T, T)] * n_layer)`; rows sum to 1 except for
            queries whose keys are all padding (all zero).
        """
        logits, _, weights = self._run(idx, None, key_padding_mask, position_ids, None, True)
        return logits, weights

    def _run(
        self,
        idx: Tensor,
        targets: Tensor | None,
        key_padding_mask: Tensor | None,
        position_ids: Tensor | None,
        kv_cache: KVCache | None,
        return_weights: bool,
        head_mask: Tensor | None = None,
        head_mean: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, list[Tensor]]:
        """Checks, then embeddings -> blocks -> final norm -> LM head (-> loss); see `forward`."""
        if idx.ndim != 2:
            raise InputError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
        B, T = idx.shape
        past = 0
        if kv_cache is not None:
            past = kv_cache.length
            kv_cache.check_fits(B, T)  # before any layer writes: a failed call changes nothing
        check_length(T, self.context_length, past)
        key_padding_mask = padding_with_cache(key_padding_mask, kv_cache, B, past, T)
        position_ids = default_position_ids(position_ids, key_padding_mask, B, past, T)
        x = self._embed(idx, position_ids, past)  # (B, T, C)
        weights = []
        for i, block in enumerate(self.blocks):
            x = block(
                x,
                key_padding_mask,
                position_ids=position_ids,
                kv_cache=kv_cache,
                layer_idx=i,
                return_weights=return_weights,
                head_mask=None if head_mask is None else head_mask[i],
                head_mean=None if head_mean is None else head_mean[i],
            )
            if return_weights:
                x, wei = x
                weights.append(wei)
        logits = self.to_logits(x)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), ignore_index=-1)
        return logits, loss, weights

    def to_logits(self, x: Tensor) -> Tensor:
        """The last block's output to logits: final norm, LM head. `(B, T, C)` -> `(B, T, V)`."""
        return self.lm_head(self.ln_f(x))

    def _embed(self, idx: Tensor, position_ids: Tensor | None, past: int) -> Tensor:
        """Token embeddings, plus learned position embeddings (none with rope), then dropout.

        Shape:
            idx `(B, T)` long, position_ids `(B, T)` or None (`past .. past + T - 1`) -> `(B, T, C)`
        """
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            if position_ids is None:
                # A slice costs a copy in backward; the whole table (the usual training case) not.
                wpe, T = self.wpe.weight, idx.shape[1]
                pos = wpe if past == 0 and T == wpe.shape[0] else wpe[past : past + T]  # (T, C)
                x = x + pos  # (B, T, C) + (T, C)
            else:
                x = x + self.wpe(position_ids)  # (B, T, C)
        if self.training and self.dropout > 0.0:
            x = F.dropout(x, self.dropout)
        return x
