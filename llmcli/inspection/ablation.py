"""Head ablation: which heads matter, measured as the rise in loss when a head is removed.

Removing a head and measuring how much the loss rises is the usual test of whether it matters
(Michel et al. 2019, "Are Sixteen Heads Really Better than One?"). How a head is removed (zero
or mean ablation, at the model's `blocks.{l}.attn.z` hook point) is `llmcli.evaluation.heads`,
which `llmcli eval --ablate` uses too; this module measures every head's Δloss.

`head_deltas` is the fast way. Removing a head of layer l changes nothing below l, so each
batch's residual stream is computed once, and for each head only layers l.. run again; the heads
of one layer run together, one copy of the batch per head, as many as `head_batch_bytes` allows.
`head_deltas_full` is the plain way, one full forward per head per batch: the reference that the
tests and `benchmarks/ablation_speed.py` compare against.

Shapes: `L` layers, `H` heads, `hs` head size; batches are `(x, y)` long `(B, T)` pairs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor

from llmcli.errors import InputError
from llmcli.evaluation.heads import (
    Batch,
    ablation_hooks,
    check_method,
    eval_mode,
    head_means,
    mask_heads,
    summed_nats,
)
from llmcli.progress import Progress, format_fixed

#: Activation memory for the copies of one batch run at once (one copy per removed head).
HEAD_BATCH_BYTES = 256 << 20


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

    @classmethod
    def from_sums(
        cls, clean: float, deltas: dict[str, np.ndarray], batches: int, tokens: int
    ) -> HeadDeltas:
        """Per-token means of nats summed over `tokens` tokens of `batches` batches: `clean`,
        the clean loss, and `deltas`, method -> `(L, H)` the rise with each head removed."""
        return cls(
            base_loss=clean / tokens,
            delta={method: d / tokens for method, d in deltas.items()},
            batches=batches,
            tokens=tokens,
        )

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
    with eval_mode(model), bar:
        for x, y in batches:
            streams, logits = _residual_streams(model, x)  # [(B, T, C)] * L, (B, T, V)
            clean_nats = summed_nats(logits, y).item()
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
    return HeadDeltas.from_sums(clean, nats, len(batches), tokens)


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
    return summed_nats(logits, y, k).cpu().numpy()


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
    with eval_mode(model):
        for x, y in batches:
            clean_nats = summed_nats(model(x)[0], y).item()
            clean, tokens = clean + clean_nats, tokens + y.numel()
            for method in methods:
                head_mean = means if method == "mean" else None  # (L, H, hs)
                for layer in range(n_layer):
                    for head in range(n_head):
                        mask = torch.ones(n_layer, n_head, device=x.device)
                        mask[layer, head] = 0.0
                        with model.hooks(ablation_hooks(mask, head_mean)):
                            logits, _ = model(x)
                        nats[method][layer, head] += summed_nats(logits, y).item() - clean_nats
    return HeadDeltas.from_sums(clean, nats, len(batches), tokens)


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
