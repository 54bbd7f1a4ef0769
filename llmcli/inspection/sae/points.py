"""A hook point as a sparse autoencoder sees it: rows of activations in, rows back out.

An SAE works on `(N, d_in)` rows: one per token. The residual stream and the sublayers' outputs
are `(B, T, C)`, so a row is a token's `C` channels; `attn.z` is `(B, T, H, hs)`, so a row is a
token's heads side by side (`H * hs`, as SAELens's `hook_z` SAEs read it). `attn.pattern` is not
a per-token activation, and no SAE reads it.

`read_activations` runs the forward only up to the hook point: a `_Stop` raised there ends it,
so nothing above the point is computed (TransformerLens's `stop_at_layer`, at any point).
`replacing` makes a hook function from a function of rows. `transformer_lens_name` spells a hook
point as TransformerLens names the same place in the Hugging Face export (`blocks.1.resid_post`
-> `blocks.1.hook_resid_post`), which SAELens's `cfg.json` records.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import Tensor, nn

from llmcli.errors import InputError
from llmcli.model.hooks import HookFn

# llmcli's hook point -> TransformerLens's name for the same activation of the exported model
# (HookedTransformer on GPT-2 weights). TransformerLens's `blocks.0.hook_resid_pre` is the
# embedding with positions added, which llmcli's `embed` is.
_BLOCK_NAMES = {
    "resid_pre": "hook_resid_pre",
    "resid_mid": "hook_resid_mid",
    "resid_post": "hook_resid_post",
    "attn_out": "hook_attn_out",
    "attn_in": "ln1.hook_normalized",
    "mlp_in": "ln2.hook_normalized",
    "mlp_out": "hook_mlp_out",
    "attn.z": "attn.hook_z",
    "attn.pattern": "attn.hook_pattern",
}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


class _Stop(Exception):
    """Raised at the hook point to end a forward whose rest nobody reads."""


def transformer_lens_name(name: str) -> str:
    """The TransformerLens name of llmcli's hook point `name` (`blocks.0.attn.z` ->
    `blocks.0.attn.hook_z`; `embed` -> `blocks.0.hook_resid_pre`; `final_norm` ->
    `ln_final.hook_normalized`)."""
    if name == "embed":
        return "blocks.0.hook_resid_pre"
    if name == "final_norm":
        return "ln_final.hook_normalized"
    match = _BLOCK.fullmatch(name)
    if match is None or match[2] not in _BLOCK_NAMES:
        raise InputError(f"{name!r} is not a hook point of an llmcli model.")
    return f"blocks.{match[1]}.{_BLOCK_NAMES[match[2]]}"


def check_hook(model: nn.Module, name: str) -> int:
    """The width `d_in` of an SAE at hook point `name` of `model`.

    Raises:
        InputError: `name` is no hook point of the model (the message names close ones), or
            is `attn.pattern`, which is no per-token activation.
    """
    if name not in model.hook_names():
        with model.hooks({name: lambda x: None}):  # raises, naming the close matches
            pass
    if name.endswith("attn.pattern"):
        raise InputError(
            f"{name!r} holds attention weights (query x key), not one activation per token: "
            "an SAE reads a residual-stream point (blocks.L.resid_post), a sublayer's output "
            "(blocks.L.attn_out, blocks.L.mlp_out) or the heads' outputs (blocks.L.attn.z)."
        )
    if name.endswith("attn.z"):
        return model.n_head * model.config.head_size
    return model.n_embed


def is_heads(name: str) -> bool:
    """Whether the point holds each head's output apart, `(B, T, H, hs)` (`attn.z`)."""
    return name.endswith("attn.z")


def as_rows(act: Tensor) -> Tensor:
    """`(B, T, C)` or `(B, T, H, hs)` -> `(B * T, d_in)`, a row per token."""
    return act.reshape(act.shape[0] * act.shape[1], -1)


def from_rows(rows: Tensor, like: Tensor) -> Tensor:
    """`(B * T, d_in)` rows back to the shape (and dtype) of the activation `like`."""
    return rows.reshape(like.shape).to(like.dtype)


@torch.no_grad()
def read_activations(model: nn.Module, name: str, idx: Tensor) -> Tensor:
    """The activation at hook point `name` for tokens `idx` `(B, T)`, the forward stopped there.

    Returns:
        `(B * T, d_in)` rows (see `as_rows`).
    """
    return read_points(model, [name], idx)[name]


@torch.no_grad()
def read_points(model: nn.Module, names: list[str], idx: Tensor) -> dict[str, Tensor]:
    """The activations at hook points `names` for tokens `idx` `(B, T)`, the forward stopped
    at the last of them to be met.

    Returns:
        name -> `(B * T, d_in)` rows (see `as_rows`).
    """
    seen: dict[str, Tensor] = {}

    def keep(name: str) -> HookFn:
        def hook(act: Tensor) -> None:
            seen[name] = act
            if len(seen) == len(names):
                raise _Stop

        return hook

    try:
        with model.hooks({name: keep(name) for name in names}):
            model(idx)
    except _Stop:
        pass
    return {name: as_rows(seen[name]) for name in names}


def replacing(fn: Callable[[Tensor], Tensor]) -> HookFn:
    """A hook function that replaces the activation by `fn` of its rows (`(N, d_in)` ->
    `(N, d_in)`), given back in the activation's shape."""

    def hook(act: Tensor) -> Tensor:
        return from_rows(fn(as_rows(act)), act)

    return hook
