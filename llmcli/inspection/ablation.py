"""Head ablation: which heads matter, measured as the rise in loss when a head is removed.

Removing a head and measuring how much the loss rises is the usual test of whether it matters
(Michel et al. 2019, "Are Sixteen Heads Really Better than One?"). A removed head's output is
zeroed before its layer's output projection (zero ablation), or replaced by its mean output over
reference positions (mean ablation: the head then carries no information about the input, but
the layers above still see its average contribution). A head is removed at the model's
`blocks.{l}.attn.z` hook point (`ablation_hooks`, `mask_heads`); this module also parses
`--ablate` specs, computes the mean head outputs and measures every head's Δloss.

`head_deltas` is the fast way. Removing a head of layer l changes nothing below l, so each
batch's residual stream is computed once, and for each head only layers l.. run again; the heads
of one layer run together, one copy of the batch per head, as many as `head_batch_bytes` allows.
`head_deltas_full` is the plain way, one full forward per head per batch: the reference that the
tests and `benchmarks/ablation_speed.py` compare against.

Shapes: `L` layers, `H` heads, `hs` head size; batches are `(x, y)` long `(B, T)` pairs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence, Sized
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from llmcli.errors import InputError
from llmcli.model.hooks import HookFn
from llmcli.progress import Progress, format_fixed

#: How a removed head is replaced: by zeros, or by its mean output.
METHODS: tuple[str, ...] = ("zero", "mean")
#: What `inspect-attention --ablation` takes: one method or both.
INSPECT_METHODS: tuple[str, ...] = ("zero", "mean", "both")
#: Activation memory for the copies of one batch run at once (one copy per removed head).
HEAD_BATCH_BYTES = 256 << 20

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
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Dropout off while measuring; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _nats(logits: Tensor, y: Tensor, copies: int = 1) -> Tensor:
    """Summed cross-entropy of each of `copies` stacked copies of a batch, in float64.

    Shape:
        logits `(copies * B, T, V)`, y `(B, T)` -> `(copies,)`
    """
    targets = y.repeat(copies, 1).flatten()  # (copies * B * T,)
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets, reduction="none")
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
    with _eval_mode(model), model.hooks(hooks), bar:
        for x, _ in batches:
            model(x)
            positions += x.numel()
            bar.update()
    if positions == 0:
        raise InputError("no batches to average the heads' outputs over.")
    means = sums / positions  # (L, C)
    return means.view(n_layer, n_head, n_embed // n_head).to(weight.dtype)  # (L, H, hs)


def _residual_streams(model: torch.nn.Module, x: Tensor) -> tuple[list[Tensor], Tensor]:
    """The input of every block (`resid_pre`) and the logits, in one forward.

    Returns:
        `([(B, T, C)] * L, logits (B, T, V))`.
    """
    streams: list[Tensor] = []
    with model.hooks({f"blocks.{i}.resid_pre": streams.append for i in range(model.n_layer)}):
        logits, _ = model(x)  # (B, T, V)
    return streams, logits


def _rerun_from(
    model: torch.nn.Module, layer: int, h: Tensor, keep: Tensor, mean: Tensor | None
) -> Tensor:
    """Layers `layer`.. and the LM head on the residual stream `h`, heads removed in `layer`.

    Shape:
        h `(B, T, C)`, keep `(B, H)` (one mask per row), mean `(H, hs)` -> logits `(B, T, V)`
    """
    remove = partial(mask_heads, keep=keep, mean=mean)
    with model.hooks({f"blocks.{layer}.attn.z": remove}):
        return model.to_logits(model.run_blocks(h, start=layer))  # (B, T, V)


# --------------------------------------------------------------------------------------------
# Δloss of every head.
# --------------------------------------------------------------------------------------------


@dataclass
class HeadDeltas:
    """Each head's Δloss: the mean loss with that head alone removed minus the clean loss.

    Attributes:
        base_loss: the clean mean loss, nats per token.
        delta: method ("zero", "mean") -> `(L, H)` float64, nats per token.
        batches, tokens: what was scored.
    """

    base_loss: float
    delta: dict[str, np.ndarray]
    batches: int
    tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "base_loss": self.base_loss,
            "delta": {method: d.tolist() for method, d in self.delta.items()},
            "batches": self.batches,
            "tokens": self.tokens,
        }


def head_batch(model: torch.nn.Module, tokens: int, budget: int = HEAD_BATCH_BYTES) -> int:
    """How many heads of one layer to remove in one pass (one copy of the batch each).

    As many as fit `budget` bytes, at least 1: a copy of a `tokens`-token batch holds its
    largest activations, the MLP's `(B, T, 4C)` and the logits `(B, T, V)`, a few at a time.
    """
    itemsize = next(model.parameters()).element_size()
    per_copy = tokens * (8 * model.n_embed + 3 * model.vocab_size) * itemsize
    return int(max(1, min(model.n_head, budget // per_copy)))


def _prepare(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    methods: Sequence[str],
    means: Tensor | None,
    progress: bool = False,
) -> tuple[list[Batch], tuple[str, ...], Tensor | None]:
    """The batches as a list, the methods checked and each once, the means "mean" needs."""
    batches = list(batches)
    if not batches:
        raise InputError("no batches to measure the heads on.")
    methods = tuple(dict.fromkeys(check_method(method) for method in methods))
    if "mean" in methods and means is None:
        means = head_means(model, batches, progress=progress)
    return batches, methods, means


@torch.no_grad()
def head_deltas(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    methods: Sequence[str] = ("zero",),
    *,
    means: Tensor | None = None,
    heads_per_pass: int | None = None,
    progress: bool = False,
) -> HeadDeltas:
    """Δloss of every head, each removed alone, with the layer cache (see the module doc).

    Args:
        model: a `Transformer`.
        batches: `(x, y)` pairs, each `(B, T)` long; all are scored.
        methods: any of `METHODS`.
        means: `(L, H, hs)` mean head outputs for "mean" (None: `head_means` of `batches`).
        heads_per_pass: heads of one layer removed in one pass (None: `head_batch`).
        progress: show progress (a bar on a terminal, plain lines elsewhere), one unit a batch;
            the mean outputs "mean" needs are a first pass with its own.

    Returns:
        `HeadDeltas`, token-weighted over the batches.
    """
    if heads_per_pass is not None and heads_per_pass < 1:
        raise InputError(f"heads_per_pass ({heads_per_pass}) must be at least 1.")
    batches, methods, means = _prepare(model, batches, methods, means, progress)
    n_layer, n_head = model.n_layer, model.n_head
    nats = {method: np.zeros((n_layer, n_head)) for method in methods}
    clean, tokens = 0.0, 0
    bar = Progress(len(batches), desc="ablation", unit="batch", enabled=progress, tenths=True)
    with _eval_mode(model), bar:
        for x, y in batches:
            streams, logits = _residual_streams(model, x)  # [(B, T, C)] * L, (B, T, V)
            clean_nats = _nats(logits, y).item()
            clean, tokens = clean + clean_nats, tokens + y.numel()
            k = heads_per_pass or head_batch(model, x.numel())
            for method in methods:
                for layer in range(n_layer):
                    mean = means[layer] if method == "mean" else None  # (H, hs)
                    for first in range(0, n_head, k):
                        heads = list(range(first, min(first + k, n_head)))
                        removed = _remove_heads(model, layer, streams[layer], y, heads, mean)
                        nats[method][layer, heads] += removed - clean_nats
            bar.update()
    return HeadDeltas(
        base_loss=clean / tokens,
        delta={method: d / tokens for method, d in nats.items()},
        batches=len(batches),
        tokens=tokens,
    )


def _remove_heads(
    model: torch.nn.Module,
    layer: int,
    h: Tensor,
    y: Tensor,
    heads: Sequence[int],
    head_mean: Tensor | None,
) -> np.ndarray:
    """Summed loss with each of `heads` of `layer` removed alone: one copy of the batch per head.

    Shape:
        h `(B, T, C)` (the residual stream into `layer`), y `(B, T)` -> `(len(heads),)` nats.
    """
    k, B = len(heads), h.shape[0]
    mask = torch.ones(k, B, model.n_head, dtype=h.dtype, device=h.device)  # (k, B, H)
    for j, head in enumerate(heads):
        mask[j, :, head] = 0.0  # copy j removes head heads[j]
    hk = h.repeat(k, 1, 1)  # (k * B, T, C)
    logits = _rerun_from(model, layer, hk, mask.view(k * B, -1), head_mean)  # (k * B, T, V)
    return _nats(logits, y, k).cpu().numpy()


@torch.no_grad()
def head_deltas_full(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    methods: Sequence[str] = ("zero",),
    *,
    means: Tensor | None = None,
) -> HeadDeltas:
    """Δloss of every head the plain way: one full forward per head per batch (the reference).

    Same arguments and result as `head_deltas`.
    """
    batches, methods, means = _prepare(model, batches, methods, means)
    n_layer, n_head = model.n_layer, model.n_head
    nats = {method: np.zeros((n_layer, n_head)) for method in methods}
    clean, tokens = 0.0, 0
    with _eval_mode(model):
        for x, y in batches:
            clean_nats = _nats(model(x)[0], y).item()
            clean, tokens = clean + clean_nats, tokens + y.numel()
            for method in methods:
                head_mean = means if method == "mean" else None  # (L, H, hs)
                for layer in range(n_layer):
                    for head in range(n_head):
                        mask = torch.ones(n_layer, n_head, device=x.device)
                        mask[layer, head] = 0.0
                        with model.hooks(ablation_hooks(mask, head_mean)):
                            logits, _ = model(x)
                        nats[method][layer, head] += _nats(logits, y).item() - clean_nats
    return HeadDeltas(
        base_loss=clean / tokens,
        delta={method: d / tokens for method, d in nats.items()},
        batches=len(batches),
        tokens=tokens,
    )


# --------------------------------------------------------------------------------------------
# Reading the result.
# --------------------------------------------------------------------------------------------


def top_heads(delta: np.ndarray, k: int = 5) -> list[tuple[int, int, float]]:
    """The `k` heads with the largest Δloss, largest first: `(layer, head, Δloss)`."""
    order = np.argsort(-delta, axis=None, kind="stable")[:k]
    return [
        (int(i // delta.shape[1]), int(i % delta.shape[1]), float(delta.flat[i])) for i in order
    ]


def format_top_heads(result: HeadDeltas, k: int = 5, data: str | None = None) -> str:
    """Lines naming the top heads by Δloss for each method, with the median for scale; `data`
    names the text measured on (None: the validation split)."""
    where = "validation batches" if data is None else f"batches of {data}"
    lines = [
        f"head ablation on {result.batches} {where} ({result.tokens:,} tokens): "
        f"clean loss {result.base_loss:.4f} nats/token"
    ]
    for method, delta in result.delta.items():
        tops = ", ".join(
            f"{layer}.{head} {format_fixed(d, '+.4f')}" for layer, head, d in top_heads(delta, k)
        )
        lines.append(
            f"top heads by dloss_{method} (layer.head, nats/token; median "
            f"{format_fixed(float(np.median(delta)), '+.4f')}): {tops}"
        )
    return "\n".join(lines)
