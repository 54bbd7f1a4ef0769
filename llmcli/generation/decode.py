"""The one-token decode step of generation, without `Transformer.forward`'s module calls.

A decode step feeds one new token per row into a KV cache. Through `Transformer.forward` it
makes about 40 module calls, with the checks, slices and views around them, and on a small model
those cost more than the arithmetic. `Decoder` collects the weights once per generation and runs
the same operations on the same values in the same order: `layer_norm` / `rms_norm`, `addmm`
(`mm` without a bias) with the transposed weight view that `F.linear` passes, the rotary
embedding's own `forward`, SDPA with the same mask, the cache written through `KVCache.update`.
One thing differs on the CPU: for a few rows the step runs GELU on ATen's own kernel rather than
oneDNN's (torch's choice for float tensors), whose set-up alone costs more than a one-token
GELU. The two kernels agree to the last bit or two, so the step's logits equal
`Transformer.forward`'s bit for bit when `forward` runs with oneDNN off too, and within a few
millionths otherwise (tests/test_decode.py checks every pair of recipe option values, with and
without padding). A sampled token could change only where the draw falls within that much of the
boundary between two tokens' cumulative probabilities (benchmarks/decode_tokens.py found no
change in 30,000 tokens). It checks nothing, so only `llmcli.generation.context_window` calls it,
with inputs that generation built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmcli.model.gpt import Block, Transformer
from llmcli.model.kv_cache import KVCache, padding_with_cache
from llmcli.model.layers import RMSNorm, qk_rms_norm
from llmcli.model.masks import allowed_keys

Fn = Callable[[Tensor], Tensor]

#: Values per GELU call up to which ATen's CPU kernel beats oneDNN's (one thread, AVX2: 4.4 vs
#: 17.7 us for 512 values, even at 16,384, 1.6x slower at 98,304).
ATEN_GELU_MAX = 16_384


def _norm(norm: nn.Module) -> Fn:
    """The functional call a `LayerNorm` or `RMSNorm` module makes, on `(B, C)`."""
    # torch.layer_norm and torch.rms_norm are what F.layer_norm and F.rms_norm call, after
    # checks that cost more than a one-token norm.
    if isinstance(norm, RMSNorm):
        weight, eps, shape = norm.weight, norm.eps, (norm.weight.shape[0],)
        return lambda x: torch.rms_norm(x, shape, weight, eps)
    if not isinstance(norm, nn.LayerNorm):
        raise TypeError(f"no decode step for the norm {type(norm).__name__}")
    shape, weight, bias, eps = norm.normalized_shape, norm.weight, norm.bias, norm.eps
    return lambda x: torch.layer_norm(x, shape, weight, bias, eps)


def _linear(linear: nn.Linear) -> Fn:
    """What `F.linear` computes for a 2-D input: `addmm(bias, x, W.t())`, or `x @ W.t()`."""
    weight_t, bias = linear.weight.t(), linear.bias  # (in, out) view, as F.linear makes it
    if bias is None:
        return lambda x: torch.mm(x, weight_t)
    return lambda x: torch.addmm(bias, x, weight_t)


class _Layer:
    """One `Block`'s weights, gathered for the decode step."""

    def __init__(self, block: Block) -> None:
        attn, mlp = block.attn, block.mlp
        self.ln1, self.ln2 = _norm(block.ln1), _norm(block.ln2)
        self.qkv, self.attn_proj = _linear(attn.qkv), _linear(attn.proj)
        self.fc, self.mlp_proj = _linear(mlp.fc), _linear(mlp.proj)
        self.relu2 = mlp.activation == "relu2"
        self.hidden = mlp.fc.out_features  # 4C
        self.qk_norm = attn.qk_norm
        self.rotary = attn.rotary
        self.n_head, self.head_size = attn.n_head, attn.head_size

    def __call__(
        self,
        x: Tensor,
        cache: KVCache,
        layer_idx: int,
        past: int,
        position_ids: Tensor | None,
        allowed: Tensor | None,
    ) -> Tensor:
        """`Block.forward` for one token per row: `(B, C)` -> `(B, C)`."""
        B, C = x.shape
        nh, hs = self.n_head, self.head_size
        # (B, 3C) -> (B, 3, nh, 1, hs): queries, keys, values as MultiHeadAttention splits them,
        # already in the (B, nh, T, hs) layout (T = 1, so no transpose is needed).
        q, k, v = self.qkv(self.ln1(x)).view(B, 3, nh, 1, hs).unbind(1)
        if self.qk_norm:
            q, k = qk_rms_norm(q), qk_rms_norm(k)
        if self.rotary is not None:  # the rotary layer takes time on dim 1: (B, 1, nh, hs)
            q = self.rotary.forward(q.transpose(1, 2), position_ids, past).transpose(1, 2)
            k = self.rotary.forward(k.transpose(1, 2), position_ids, past).transpose(1, 2)
        k, v = cache.update(layer_idx, k, v)  # each (B, nh, past + 1, hs)
        # One new token sees every cached key (SDPA without a mask), or the real ones.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # (B, nh, 1, hs)
        x = x + self.attn_proj(y.view(B, C))  # (B, C)
        h = self.fc(self.ln2(x))  # (B, 4C)
        h = F.relu(h).square() if self.relu2 else F.gelu(h)
        return x + self.mlp_proj(h)  # (B, C)


class Decoder:
    """`Transformer.forward(idx, position_ids=..., kv_cache=cache)` for one token per row.

    Built once per generation from a model in eval mode; the model's weights must not be
    replaced while it is in use (the transposed views point at them).
    """

    def __init__(self, model: Transformer) -> None:
        self.layers = [_Layer(block) for block in model.blocks]
        self.wte = model.wte.weight
        self.wpe = None if model.wpe is None else model.wpe.weight
        self.ln_f = _norm(model.ln_f)
        self.lm_head_t = model.lm_head.weight.t()  # (C, V) view
        self.causal = model.blocks[0].attn.causal if model.blocks else None
        self.device_type = self.wte.device.type
        # Values of one row's GELU input, on the CPU (0: no GELU to move off oneDNN).
        gelu = [layer.hidden for layer in self.layers if not layer.relu2]
        self.gelu_width = max(gelu, default=0) if self.device_type == "cpu" else 0

    def __call__(self, idx: Tensor, cache: KVCache, position_ids: Tensor | None) -> Tensor:
        """Logits `(B, V)` of the token after `idx`.

        Args:
            idx: `(B,)` long, the newest token of every row (a real token, never padding).
            cache: the generation's cache, holding at least one position.
            position_ids: `(B, 1)` long positions of `idx`, or None for the cache length.
        """
        small = 0 < idx.shape[0] * self.gelu_width <= ATEN_GELU_MAX
        if not small or not torch.backends.mkldnn.enabled:
            return self._step(idx, cache, position_ids)
        # On the CPU, GELU goes through oneDNN, whose set-up costs about 15 us a call: more than
        # a few rows' GELU takes on ATen's own kernel; it was a third of a tiny model's step.
        # oneDNN is faster on large inputs (`ATEN_GELU_MAX`), so it stays on for them and outside
        # the step. The two kernels agree to the last bit or two. The flag is process-wide:
        # another thread's GELU during the step takes ATen's kernel too.
        torch.backends.mkldnn.enabled = False
        try:
            return self._step(idx, cache, position_ids)
        finally:
            torch.backends.mkldnn.enabled = True

    def _step(self, idx: Tensor, cache: KVCache, position_ids: Tensor | None) -> Tensor:
        B, past = idx.shape[0], cache.length
        x = F.embedding(idx, self.wte)  # (B, C)
        if self.wpe is not None:
            if position_ids is None:
                x = x + self.wpe[past]  # (B, C) + (C,)
            else:
                x = x + F.embedding(position_ids.view(B), self.wpe)  # (B, C)
        mask = padding_with_cache(None, cache, B, past, 1)  # (B, past + 1) or None
        allowed = None
        if mask is not None:  # the new token is real, so no query is left without a key
            allowed = allowed_keys(self.causal[past : past + 1, : past + 1], mask)[0]
        for i, layer in enumerate(self.layers):
            x = layer(x, cache, i, past, position_ids, allowed)
        return torch.mm(self.ln_f(x), self.lm_head_t)  # (B, C) @ (C, V) -> (B, V)


def decoder_for(model: object) -> Decoder | None:
    """A `Decoder` for a `Transformer` in eval mode; None for anything else (a model in
    training mode, whose dropout the decode step leaves out, or another module), which is then
    called through its `forward`."""
    if isinstance(model, Transformer) and not model.training:
        return Decoder(model)
    return None
