"""A faster one-token decode step: the model's forward for one new token per row, run as
plain functions of its weights.

A decode step feeds one new token per row into the KV cache. Through `Transformer.forward` it
makes about 40 module calls, and on a small model their bookkeeping costs more than the
arithmetic: on the `tiny` shape a step takes about twice as long through the forward as here
(benchmarks/model_speed.py, `fast_vs_forward`). `FastDecoder` computes the same operations on the
same weights (`torch.addmm` as `nn.Linear` does for one row, the norms' own functions, SDPA
over the cached keys) with the residual stream `(B, C)` and no hook points, writes the new keys
and values into the cache as `MultiHeadAttention` does, and keeps the cache's views of each
position for the steps that come back to it (a `shift` generation refills the same positions
over and over). The model does not know this module exists.

It applies to a `Transformer` in eval mode with no hook function at work and no autocast
(`FastDecoder.for_model`, and at every step: hooks must see every step, so a hooked model decodes
through its forward). `generate` uses it by default (`decode="auto"`), so every command that
generates does; `decode=None` runs every step through the model's forward.

The logits equal the forward's bit for bit, except that on the CPU a small GELU runs on ATen's
kernel rather than oneDNN's (`_AtenGeluHidden`): they then equal the forward run with oneDNN
off, and agree with the forward on oneDNN to within a few float32 ulps, drawing the same tokens
(tests/test_fast_decode.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmcli.model.gpt import Transformer
from llmcli.model.hooks import HookPoint
from llmcli.model.kv_cache import KVCache
from llmcli.model.layers import RMSNorm, RotaryEmbedding, qk_rms_norm, rotate

Fn = Callable[[Tensor], Tensor]
Linear = Callable[..., Tensor]  # rows (B, in) [, out=] -> (B, out)

#: Values per GELU call up to which ATen's CPU kernel beats oneDNN's (one thread, AVX2: 2.4 vs
#: 10.8 us for 512 values, at 16,384 about even).
ATEN_GELU_MAX = 16_384
#: The most tensor views a decoder keeps for the positions steps come back to (a few hundred
#: bytes each).
MAX_KEPT_VIEWS = 16_384


def _linear(linear: nn.Linear) -> Linear:
    """What `nn.Linear` computes for rows `(B, in)`: `addmm(b, x, W.t())`, or `x @ W.t()`;
    into `out` where one is given."""
    weight_t, bias = linear.weight.t(), linear.bias  # (in, out) view, made once, not per call
    if bias is None:
        return lambda x, out=None: torch.mm(x, weight_t, out=out)
    return lambda x, out=None: torch.addmm(bias, x, weight_t, out=out)


def _norm(norm: nn.Module) -> Fn:
    """The function a `LayerNorm` or `RMSNorm` module calls."""
    if isinstance(norm, RMSNorm):
        weight, eps, shape = norm.weight, norm.eps, (norm.weight.shape[0],)
        return lambda x: torch.rms_norm(x, shape, weight, eps)
    shape, weight, bias, eps = norm.normalized_shape, norm.weight, norm.bias, norm.eps
    return lambda x: torch.layer_norm(x, shape, weight, bias, eps)


@dataclass
class _Block:
    """One block's weights as functions of rows `(B, C)`."""

    ln1: Fn
    qkv: Linear
    proj: Linear
    ln2: Fn
    fc: Linear
    mlp_proj: Linear


def _relu2_hidden(block: _Block, x: Tensor) -> Tensor:
    return F.relu(block.fc(x)).square()  # (B, 4C)


def _gelu_hidden(block: _Block, x: Tensor) -> Tensor:
    return F.gelu(block.fc(x))  # (B, 4C)


class _AtenGeluHidden:
    """The MLP's hidden rows `gelu(fc(x))` `(B, 4C)` on the CPU, GELU on ATen's kernel.

    torch sends a contiguous float GELU on the CPU to oneDNN, whose set-up costs more than a
    decode step's few rows take on ATen's own (vectorised) kernel. oneDNN takes contiguous inputs
    only, so GELU reads a stride-0 view of two copies of the rows and runs on ATen's kernel,
    without touching the process-wide oneDNN switch. No tensor is made per call: `fc` writes
    into a buffer, GELU reads its view into a second buffer, and the first copy there is the
    result, valid until the next call. Buffers made in inference mode serve only there.
    """

    def __init__(self) -> None:
        self.shape: tuple[int, int, bool] | None = None

    def __call__(self, block: _Block, x: Tensor) -> Tensor:
        B, width = x.shape[0], 4 * x.shape[1]
        if B * width > ATEN_GELU_MAX:
            return _gelu_hidden(block, x)
        key = (B, width, torch.is_inference_mode_enabled())
        if self.shape != key:
            self.shape = key
            self.h = torch.empty(B, width, dtype=x.dtype, device=x.device)  # fc's output
            self.twice = self.h.expand(2, B, width)  # (2, B, 4C): oneDNN refuses it
            self.out = torch.empty(2, B, width, dtype=x.dtype, device=x.device)
            self.first = self.out[0]  # (B, 4C)
        block.fc(x, out=self.h)
        F.gelu(self.twice, out=self.out)
        return self.first


class _QKVRows:
    """The attention's rows `q, k, v` `(B, nh, 1, hs)` of `qkv(x)`: views made once of one
    buffer that `qkv` writes into, so that a step makes no view per layer. The views are valid
    until the next call (each layer's keys and values are copied into the cache first)."""

    def __init__(self, n_head: int, head_size: int) -> None:
        self.n_head, self.head_size = n_head, head_size
        self.shape: tuple[int, bool] | None = None

    def __call__(self, block: _Block, x: Tensor) -> tuple[Tensor, ...]:
        B, nh, hs = x.shape[0], self.n_head, self.head_size
        key = (B, torch.is_inference_mode_enabled())
        if self.shape != key:
            self.shape = key
            self.out = torch.empty(B, 3 * nh * hs, dtype=x.dtype, device=x.device)  # (B, 3C)
            self.rows = self.out.view(B, 3, nh, 1, hs).unbind(1)  # each (B, nh, 1, hs)
        block.qkv(x, out=self.out)
        return self.rows


def _mlp_hidden(mlp: str, device: torch.device) -> Callable[[_Block, Tensor], Tensor]:
    """How the decode step computes a block's MLP hidden rows from `ln2(x)`."""
    if mlp == "relu2":
        return _relu2_hidden
    return _AtenGeluHidden() if device.type == "cpu" else _gelu_hidden


def through_forward(model: nn.Module, points: list[HookPoint], device_type: str) -> bool:
    """Whether a decode step must run through the model's forward now: in training mode (the
    step leaves dropout out), under autocast, or with a hook function at work (hooks see every
    step). `points` are the model's hook points."""
    if model.training or torch.is_autocast_enabled(device_type):
        return True
    for point in points:
        if point.fns:
            return True
    return False


class FastDecoder:
    """`model(idx[:, None], mask=mask, input_pos=input_pos, kv_cache=cache)[0][:, -1]` for one
    token per row, without module calls.

    Built once per generation from a model in eval mode; the model's weights must not be
    replaced while it is in use (the functions hold them).
    """

    def __init__(self, model: Transformer) -> None:
        config = model.config
        self.model = model
        self.n_embed = model.n_embed
        self.qk_norm = config.qk_norm
        self.mlp_hidden = _mlp_hidden(config.mlp, model.wte.weight.device)
        self.qkv_rows = _QKVRows(config.n_head, config.head_size)
        self.wte = model.wte.weight  # (V, C)
        self.wpe = None if model.wpe is None else model.wpe.weight  # (L, C)
        self.rotary: RotaryEmbedding | None = model.blocks[0].attn.rotary  # the same in every layer
        self.blocks = [
            _Block(
                _norm(b.ln1),
                _linear(b.attn.qkv),
                _linear(b.attn.proj),
                _norm(b.ln2),
                _linear(b.mlp.fc),
                _linear(b.mlp.proj),
            )
            for b in model.blocks
        ]
        self.ln_f, self.lm_head = _norm(model.ln_f), _linear(model.lm_head)
        self.points = [m for m in model.modules() if isinstance(m, HookPoint)]
        self.device_type = self.wte.device.type
        self._cache: KVCache | None = None
        self._kept: dict[int, tuple[tuple[Tensor, ...], ...]] = {}  # past -> the views (_views)

    @classmethod
    def for_model(cls, model: Any) -> FastDecoder | None:
        """A decoder for a `Transformer` in eval mode; None for anything else (a model in
        training mode, whose dropout this leaves out, a model with a layer that computes more
        than its weight, such as a LoRA adapter applied on the fly, or another module), which
        then decodes through its forward."""
        if not isinstance(model, Transformer) or model.training:
            return None
        linears = (m for m in model.modules() if isinstance(m, nn.Linear))
        if any(type(m) is not nn.Linear for m in linears):  # _linear reads only the weight
            return None
        return cls(model)

    def __call__(
        self, idx: Tensor, cache: KVCache, mask: Tensor | None, input_pos: Tensor | None
    ) -> Tensor | None:
        """Logits `(B, V)` of the token after `idx`, or None where this does not apply now (a
        hook function at work, autocast, the model in training mode): the caller then runs the
        model's forward.

        Args:
            idx: `(B,)` long, the newest token of every row.
            cache: the generation's cache, holding the positions before `idx`.
            mask: `(B, 1, 1, T_k)` bool over the cached keys and the new one, or None for all.
            input_pos: `(B, 1)` long positions of `idx`, or None for the cache length.
        """
        if through_forward(self.model, self.points, self.device_type):
            return None
        B, C, past = idx.shape[0], self.n_embed, cache.length
        cache.check_room(B, 1)
        x = F.embedding(idx, self.wte)  # (B, C)
        if self.wpe is not None:
            if input_pos is None:
                x = x + self.wpe[past]  # (B, C) + (C,)
            else:
                x = x + F.embedding(input_pos.view(-1), self.wpe)  # (B, C)
        rotation = None if self.rotary is None else self.rotary.angles(1, input_pos, past)
        k_new, v_new, k_all, v_all = self._views(cache, past)
        for i, block in enumerate(self.blocks):
            q, k, v = self.qkv_rows(block, block.ln1(x))  # each (B, nh, 1, hs)
            if self.qk_norm:
                q, k = qk_rms_norm(q), qk_rms_norm(k)
            if rotation is not None:
                q, k = rotate(q, rotation), rotate(k, rotation)
            k_new[i].copy_(k)
            v_new[i].copy_(v)
            y = F.scaled_dot_product_attention(q, k_all[i], v_all[i], mask, 0.0, False)
            x += block.proj(y.view(B, C))  # (B, nh, 1, hs) -> (B, C), heads side by side
            x += block.mlp_proj(self.mlp_hidden(block, block.ln2(x)))  # (B, 4C) -> (B, C)
        cache.advance(1)
        return self.lm_head(self.ln_f(x))  # (B, V)

    def _views(self, cache: KVCache, past: int) -> tuple[tuple[Tensor, ...], ...]:
        """Every layer's views `(B, nh, ., hs)` of the keys and values at position `past`, and
        at every position up to it: `(k_new, v_new, k_all, v_all)`, each one view per layer.

        One `unbind` makes a step's views for all layers; they are kept for the steps that come
        back to `past` (after a `reset`, a `shift` past the context), at most `MAX_KEPT_VIEWS`.
        """
        if cache is not self._cache:
            self._cache, self._kept = cache, {}
        views = self._kept.get(past)
        if views is None:
            views = tuple(
                x.narrow(3, start, length).unbind(0)  # n_layer views (B, nh, length, hs)
                for start, length in ((past, 1), (0, past + 1))
                for x in (cache.k, cache.v)
            )
            if len(self._kept) * 4 * len(self.blocks) < MAX_KEPT_VIEWS:
                self._kept[past] = views
        return views
