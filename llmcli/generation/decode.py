"""The one-token decode step: the model's own forward code, without its module calls.

A decode step feeds one new token per row into a KV cache. Through `Transformer.forward` it makes
about 40 module calls, each with `nn.Module.__call__`'s bookkeeping, and on a small model those
cost more than the arithmetic. `Decoder` runs the blocks' own code, `Block.forward`,
`MultiHeadAttention.forward` and `MLP.forward` unchanged, on twins of the modules: plain objects
whose `__call__` is the module class's `forward` and whose layers are plain functions of the
same weights (the `addmm` that `F.linear`
runs on a 2-D input, the norm's own `torch.layer_norm` / `torch.rms_norm`, `F.embedding`), with
no hook points listening. The residual stream is `(B, C)`, one token per row, a layout
`MultiHeadAttention.forward` takes for this. So there is one block to read, and the step
computes exactly what `forward` does, bit for bit (tests/test_decode.py checks every pair of
recipe option values, with and without padding).

`decoder_for` gives a `Decoder` only for a `Transformer` in eval mode with no hook function at
work (hooks must see every step, so a hooked model decodes through `forward`). On the CPU,
`small_gelu` picks ATen's GELU kernel for a generation whose decode steps are small.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmcli.model.attention import AttentionContext
from llmcli.model.gpt import MLP, Block, MultiHeadAttention, Transformer
from llmcli.model.hooks import HookPoint, hooks_active
from llmcli.model.kv_cache import KVCache
from llmcli.model.layers import RMSNorm

Fn = Callable[[Tensor], Tensor]

#: Values per GELU call up to which ATen's CPU kernel beats oneDNN's (one thread, AVX2: 4.4 vs
#: 17.7 us for 512 values, even at 16,384, 1.6x slower at 98,304).
ATEN_GELU_MAX = 16_384


def _same(x: Tensor) -> Tensor:
    """A hook point with nobody listening."""
    return x


class _Silent:
    """An `attn.pattern` hook point with nobody listening: the weights are not computed."""

    active = False


def _linear(linear: nn.Linear) -> Fn:
    """What `F.linear` computes for a 2-D input: `addmm(b, x, W.t())`, or `x @ W.t()`."""
    weight_t, bias = linear.weight.t(), linear.bias  # (in, out) view, made once, not per call
    if bias is None:
        return lambda x: torch.mm(x, weight_t)
    return lambda x: torch.addmm(bias, x, weight_t)


def _norm(norm: nn.Module) -> Fn:
    """The function a `LayerNorm` or `RMSNorm` module calls, without `F.layer_norm`'s checks."""
    if isinstance(norm, RMSNorm):
        weight, eps, shape = norm.weight, norm.eps, (norm.weight.shape[0],)
        return lambda x: torch.rms_norm(x, shape, weight, eps)
    if not isinstance(norm, nn.LayerNorm):
        raise TypeError(f"no decode step for the norm {type(norm).__name__}")
    shape, weight, bias, eps = norm.normalized_shape, norm.weight, norm.bias, norm.eps
    return lambda x: torch.layer_norm(x, shape, weight, bias, eps)


class _Twin:
    """Stands in for a module in its class's own forward: attributes, and nothing to train."""

    training = False


class _Attention(_Twin):
    __call__ = MultiHeadAttention.forward

    def __init__(self, attn: MultiHeadAttention) -> None:
        self.config, self.layer_idx = attn.config, attn.layer_idx
        self.n_head, self.head_size = attn.n_head, attn.head_size
        self.dropout, self.attn_dropout = attn.dropout, attn.attn_dropout
        self.qk_norm, self.rotary = attn.qk_norm, attn.rotary
        self.qkv, self.proj = _linear(attn.qkv), _linear(attn.proj)
        self.pattern, self.z = _Silent(), _same


class _MLP(_Twin):
    __call__ = MLP.forward

    def __init__(self, mlp: MLP) -> None:
        self.activation, self.dropout = mlp.activation, mlp.dropout
        self.fc, self.proj = _linear(mlp.fc), _linear(mlp.proj)


class _Block(_Twin):
    __call__ = Block.forward

    def __init__(self, block: Block) -> None:
        self.ln1, self.attn = _norm(block.ln1), _Attention(block.attn)
        self.ln2, self.mlp = _norm(block.ln2), _MLP(block.mlp)
        self.resid_pre = self.attn_out = self.resid_mid = self.mlp_out = self.resid_post = _same


class Decoder:
    """`Transformer.forward(idx, position_ids=..., kv_cache=cache)` for one token per row.

    Built once per generation from a model in eval mode; the model's weights must not be
    replaced while it is in use (the functions hold them). The embedding and the LM head around
    the blocks are those of `Transformer.embedding` and `Transformer.to_logits` in the step's
    `(B, C)` layout, with no hook point or dropout to pass (the model is in eval mode, unhooked).
    """

    def __init__(self, model: Transformer) -> None:
        self.wte = model.wte.weight  # (V, C)
        self.wpe = None if model.wpe is None else model.wpe.weight  # (L, C)
        self.blocks = [_Block(block) for block in model.blocks]
        self.ln_f, self.lm_head = _norm(model.ln_f), _linear(model.lm_head)
        self.device_type = self.wte.device.type

    def applies(self) -> bool:
        """Whether a step may run here now: not under autocast (the twins call the operations
        `forward` would, not through the modules autocast treats differently), and no hook
        function at work anywhere (a hooked model decodes through `forward`, so that its
        functions see every step)."""
        return not (hooks_active() or torch.is_autocast_enabled(self.device_type))

    def __call__(self, idx: Tensor, cache: KVCache, position_ids: Tensor | None) -> Tensor:
        """Logits `(B, V)` of the token after `idx`.

        Args:
            idx: `(B,)` long, the newest token of every row (a real token, never padding).
            cache: the generation's cache, holding at least one position.
            position_ids: `(B, 1)` long positions of `idx`, or None for the cache length.
        """
        ctx = AttentionContext.decode_step(cache, position_ids)
        x = F.embedding(idx, self.wte)  # (B, C): one token per row
        if self.wpe is not None:
            if position_ids is None:
                x = x + self.wpe[ctx.past]  # (B, C) + (C,)
            else:
                x = x + F.embedding(position_ids.view(-1), self.wpe)  # (B, C)
        for block in self.blocks:
            x = block(x, ctx)  # (B, C)
        return self.lm_head(self.ln_f(x))  # (B, V)


def decoder_for(model: Any) -> Decoder | None:
    """A `Decoder` for a `Transformer` in eval mode with no hook function at work; None for
    anything else (a model in training mode, whose dropout the twins leave out, a hooked model,
    a norm the twins do not know, another module), which is then called through its `forward`.
    A step checks `Decoder.applies` too: hooks may come while a generation runs."""
    if not isinstance(model, Transformer) or model.training:
        return None
    if any(m.active for m in model.modules() if isinstance(m, HookPoint)):
        return None
    try:
        return Decoder(model)
    except TypeError:  # a norm module the twins cannot call as a function
        return None


@contextmanager
def small_gelu(model: Any, batch_size: int) -> Iterator[None]:
    """Run GELU on ATen's own CPU kernel rather than oneDNN's while generating with small steps.

    On the CPU torch sends float GELU to oneDNN, whose set-up costs about 15 us a call: more than
    a few rows' GELU takes on ATen's kernel (a third of the tiny model's decode step). For a
    GELU model on the CPU whose decode step holds at most `ATEN_GELU_MAX` values
    (`batch_size * 4 * n_embed`), this turns oneDNN off until the block ends; oneDNN is faster on
    large inputs and stays on otherwise. The two kernels agree to the last bit or two. The switch
    is process-wide: for the while of the block, other GELUs of the process take ATen's kernel
    too. `llmcli sample` runs its generation inside it.
    """
    config = getattr(model, "config", None)
    weight = next(model.parameters(), None) if isinstance(model, nn.Module) else None
    small = (
        getattr(config, "mlp", None) == "gelu"
        and weight is not None
        and weight.device.type == "cpu"
        and 0 < batch_size * 4 * config.n_embed <= ATEN_GELU_MAX
    )
    if not small or not torch.backends.mkldnn.enabled:
        yield
        return
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = True
