"""Removing heads: which heads (`--ablate L.H|L`), how (`--ablation zero|mean`), and the hook
functions that do it.

A removed head's output is zeroed before its layer's output projection (zero ablation), or
replaced by its mean output over reference positions (mean ablation: the head then carries no
information about the input, but the layers above still see its average contribution). A head is
removed at the model's `blocks.{l}.attn.z` hook point (`ablation_hooks`, `mask_heads`).
`llmcli eval --ablate` scores a model so; `llmcli.inspection.ablation` measures every head's
Δloss with the same functions.

Shapes: `L` layers, `H` heads, `hs` head size; batches are `(x, y)` long `(B, T)` pairs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence, Sized
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor

from llmcli.errors import InputError
from llmcli.evaluation.text import token_losses
from llmcli.model.hooks import HookFn
from llmcli.progress import Progress

#: How a removed head is replaced: by zeros, or by its mean output.
METHODS: tuple[str, ...] = ("zero", "mean")

# ASCII digits (`\d` takes any script's), at most 9 (more is past any layer; `int` refuses more
# than 4,300 digits).
_SPEC = re.compile(r"([0-9]{1,9})(?:\.([0-9]{1,9}))?")

Batch = tuple[Tensor, Tensor]


# --------------------------------------------------------------------------------------------
# Options: `--ablate L.H|L` and `--ablation zero|mean|both`.
# --------------------------------------------------------------------------------------------


def _spec_forms(n_layer: int, n_head: int) -> str:
    return (
        f"write L.H for head H of layer L, or L for every head of layer L, with L from 0 to "
        f"{n_layer - 1} and H from 0 to {n_head - 1} (this model has {n_layer} layers of "
        f"{n_head} heads), e.g. --ablate {n_layer - 1}.0"
    )


def parse_ablate(specs: Sequence[str], n_layer: int, n_head: int) -> Tensor:
    """`--ablate` specs to a head mask.

    Args:
        specs: each `"L.H"` (head H of layer L) or `"L"` (every head of layer L), 0-based.
        n_layer, n_head: the model's sizes.

    Returns:
        float32 `(n_layer, n_head)`: 1 keeps a head, 0 removes it.

    Raises:
        InputError: a spec of another form, or past the last layer or head; the message names
            the forms and the valid ranges.
    """
    mask = torch.ones(n_layer, n_head)
    for spec in specs:
        match = _SPEC.fullmatch(spec.strip())
        if match is None:
            raise InputError(
                f"--ablate {spec!r} is not a head or a layer: {_spec_forms(n_layer, n_head)}."
            )
        layer, head = int(match[1]), None if match[2] is None else int(match[2])
        if layer >= n_layer:
            raise InputError(
                f"--ablate {spec}: layer {layer} is past the last layer "
                f"({n_layer - 1}): {_spec_forms(n_layer, n_head)}."
            )
        if head is not None and head >= n_head:
            raise InputError(
                f"--ablate {spec}: head {head} is past the last head "
                f"({n_head - 1}): {_spec_forms(n_layer, n_head)}."
            )
        mask[layer, slice(None) if head is None else head] = 0.0
    return mask


def check_method(method: str, choices: Sequence[str] = METHODS) -> str:
    """`--ablation` checked against `choices`; returns it.

    Raises:
        InputError: not one of `choices` (the message lists them).
    """
    if method not in choices:
        raise InputError(
            f"--ablation {method!r} is not known: choose {' or '.join(choices)} (zero: a removed "
            "head outputs zeros; mean: its mean output over the scored positions)."
        )
    return method


# --------------------------------------------------------------------------------------------
# Removing heads, and the model's pieces, through its hook points.
# --------------------------------------------------------------------------------------------


def mask_heads(z: Tensor, keep: Tensor, mean: Tensor | None = None) -> Tensor:
    """Keep (1) or remove (0) each head's output; a removed head outputs zeros, or its `mean`.

    With a mask of ones the values of `z` come back unchanged, bit for bit (`z * 1`, `+ 0 *
    mean`).

    Shape:
        z `(B, T, nh, hs)` (the `attn.z` hook point); keep `(nh,)` or, one mask per batch row,
        `(B, nh)`; mean `(nh, hs)` -> `(B, T, nh, hs)`.
    """
    m = keep.to(z.dtype)
    m = m[:, None, :, None] if m.ndim == 2 else m[:, None]  # (B, 1, nh, 1) or (nh, 1)
    z = z * m  # (B, T, nh, hs)
    if mean is not None:
        z = z + (1 - m) * mean.to(z.dtype)  # (B, T, nh, hs) + (nh, hs)
    return z


def ablation_hooks(mask: Tensor, means: Tensor | None = None) -> dict[str, HookFn]:
    """Hook functions that remove the heads `mask` marks, for `Transformer.hooks`.

    Args:
        mask: `(L, H)`: 1 keeps a head, 0 removes it.
        means: `(L, H, hs)`: what removed heads output instead of zeros (mean ablation).

    Returns:
        `blocks.{l}.attn.z` -> a function, for each layer with a head removed.
    """
    return {
        f"blocks.{layer}.attn.z": partial(
            mask_heads, keep=mask[layer], mean=None if means is None else means[layer]
        )
        for layer in range(mask.shape[0])
        if bool((mask[layer] != 1).any())
    }


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Dropout off while measuring; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def summed_nats(logits: Tensor, y: Tensor, copies: int = 1) -> Tensor:
    """Summed cross-entropy of each of `copies` stacked copies of a batch, in float64.

    Shape:
        logits `(copies * B, T, V)`, y `(B, T)` -> `(copies,)`
    """
    nll = token_losses(logits, y.repeat(copies, 1))  # (copies * B, T)
    return nll.double().view(copies, -1).sum(1)  # (copies,)


@torch.no_grad()
def head_means(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    *,
    progress: bool = False,
    total: int | None = None,
) -> Tensor:
    """Every head's mean output (`attn.z`) over every position of `batches`, no head removed.

    Args:
        model: a `Transformer`.
        batches: `(x, y)` pairs, each `(B, T)` long.
        progress: show progress (a bar on a terminal, plain lines elsewhere), one unit a batch.
        total: how many batches there are, for the progress (None: `len(batches)` if it has
            one).

    Returns:
        `(L, H, hs)`, in the model's dtype and on its device.

    Raises:
        InputError: `batches` is empty.
    """
    n_layer, n_head, n_embed = model.n_layer, model.n_head, model.n_embed
    weight = next(model.parameters())
    sums = torch.zeros(n_layer, n_embed, dtype=torch.float64, device=weight.device)

    def summing(layer: int) -> HookFn:
        def add(z: Tensor) -> None:  # (B, T, nh, hs): heads side by side, as `proj` reads them
            sums[layer] += z.reshape(-1, n_embed).sum(0, dtype=torch.float64)  # (C,)

        return add

    positions = 0
    hooks = {f"blocks.{i}.attn.z": summing(i) for i in range(n_layer)}
    if total is None and isinstance(batches, Sized):
        total = len(batches)
    bar = Progress(total, desc="head means", unit="batch", enabled=progress, tenths=True)
    with eval_mode(model), model.hooks(hooks), bar:
        for x, _ in batches:
            model(x)
            positions += x.numel()
            bar.update()
    if positions == 0:
        raise InputError("no batches to average the heads' outputs over.")
    means = sums / positions  # (L, C)
    return means.view(n_layer, n_head, n_embed // n_head).to(weight.dtype)  # (L, H, hs)
