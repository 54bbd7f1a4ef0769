"""`llmcli sae eval --sae TRANSCODERS`: how well a transcoder set stands in for the MLPs, every
layer replaced at once.

On the windows `sae eval` reads (`evaluate.read_batches`), two passes:

1. the clean forward, each layer's MLP input and output read: per layer, the normalised MSE of
   the transcoder's prediction (`sum |y - ŷ|² / sum |y - mean(y)|²`, over every token), the mean
   number of active features (L0) and the features active on no token (`dead_fraction`); and
   the clean loss `ce_clean`;
2. two forwards with every MLP replaced at once: by its transcoder, reading the MLP input of
   that same forward (`ce_replaced`: errors compound through the layers, as in the replacement
   model without error terms), and by zeros (`ce_zero`).

`ce_recovered = (ce_zero - ce_replaced) / (ce_zero - ce_clean)` (1: as good as the MLPs).
Losses are mean cross-entropy in nats per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from llmcli.device import resolve_device
from llmcli.inspection.sae.evaluate import ReadOptions, loss_sum, measured, run_of
from llmcli.inspection.sae.transcoder_folder import (
    LoadedTranscoders,
    check_fits,
    load_transcoders,
)
from llmcli.model.hooks import HookFn
from llmcli.progress import Progress
from llmcli.runs.loading import LoadedRun, load_run


@dataclass
class TranscoderEval:
    """What `evaluate_transcoders` measured (module doc); `to_dict` is `--json`'s."""

    transcoders: str
    run: str
    layers: list[int]
    features: int
    data: str
    tokens: int
    nmse: list[float]
    l0: list[float]
    dead_fraction: list[float]
    ce_clean: float
    ce_replaced: float
    ce_zero: float
    ce_recovered: float
    elapsed_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def open_transcoder_set(
    options: ReadOptions, notify: Callable[[str], Any]
) -> tuple[LoadedTranscoders, LoadedRun]:
    """The set `options.sae` names and its run, checked against each other."""
    device = resolve_device(options.device, what="--device")
    loaded = load_transcoders(options.sae)
    checkpoint = options.checkpoint or run_of(loaded)
    run = load_run(checkpoint, weights=options.weights, device=device, notify=notify)
    stale = check_fits(loaded, run, "evaluate them on the run they were trained on.")
    if stale is not None:  # measured all the same: how well they read these weights
        notify(f"{stale}: the figures measure them on these weights")
    loaded.transcoders.to(device)
    return loaded, run


@torch.no_grad()
def measure_transcoders(
    loaded: LoadedTranscoders,
    run: LoadedRun,
    batches: list[tuple[Tensor, Tensor]],
    *,
    progress: bool = False,
) -> dict[str, Any]:
    """The figures of the module doc on `batches` of `(x, y)` windows, each `(B, T)`."""
    model, tcs = run.model, loaded.transcoders
    n = len(tcs.layers)
    err, y_sum, y_sq = torch.zeros(n), torch.zeros(n, model.n_embed), torch.zeros(n)
    active = torch.zeros(n)
    fired = torch.zeros(n, tcs.d_transcoder, dtype=torch.bool)
    clean, tokens = 0.0, 0
    bar = Progress(2 * len(batches), desc="sae eval", unit="batch", enabled=progress, tenths=True)
    names = [f"blocks.{layer}.mlp_{end}" for layer in tcs.layers for end in ("in", "out")]
    seen: dict[str, Tensor] = {}
    hooks = {name: (lambda t, name=name: seen.__setitem__(name, t)) for name in names}
    for x, y in batches:
        with model.hooks(hooks):
            logits, _ = model(x)
        clean += loss_sum(logits, y)
        for i, (layer, tc) in enumerate(zip(tcs.layers, tcs.transcoders, strict=True)):
            inp = seen[f"blocks.{layer}.mlp_in"].flatten(0, 1).float()  # (N, C)
            out = seen[f"blocks.{layer}.mlp_out"].flatten(0, 1).float()  # (N, C)
            acts = tc.encode(inp)  # (N, F)
            err[i] += (tc.decode(acts, inp) - out).pow(2).sum().cpu()
            y_sum[i] += out.sum(0).cpu()
            y_sq[i] += out.pow(2).sum().cpu()
            active[i] += (acts != 0).sum().cpu()
            fired[i] |= (acts != 0).any(0).cpu()
        tokens += x.numel()
        bar.update()
    nats = {"replaced": 0.0, "zero": 0.0}
    for x, y in batches:
        for name, replace in (("replaced", _replacing(tcs)), ("zero", _zeroing(tcs.layers))):
            with model.hooks(replace):
                nats[name] += loss_sum(model(x)[0], y)
        bar.update()
    bar.close()
    variance = y_sq - y_sum.pow(2).sum(-1) / tokens  # (n,)
    ce_clean = clean / tokens
    ce = {name: value / tokens for name, value in nats.items()}
    return {
        "tokens": tokens,
        "nmse": (err / variance).tolist(),
        "l0": (active / tokens).tolist(),
        "dead_fraction": (1.0 - fired.float().mean(-1)).tolist(),
        "ce_clean": ce_clean,
        "ce_replaced": ce["replaced"],
        "ce_zero": ce["zero"],
        "ce_recovered": (ce["zero"] - ce["replaced"]) / (ce["zero"] - ce_clean),
    }


def _replacing(tcs: Any) -> dict[str, HookFn]:
    """Every layer's MLP output replaced by its transcoder on the MLP input of this forward."""
    seen: dict[int, Tensor] = {}
    hooks: dict[str, HookFn] = {}
    for layer, tc in zip(tcs.layers, tcs.transcoders, strict=True):
        hooks[f"blocks.{layer}.mlp_in"] = lambda t, layer=layer: seen.__setitem__(layer, t)
        hooks[f"blocks.{layer}.mlp_out"] = lambda t, layer=layer, tc=tc: tc(seen[layer]).to(t.dtype)
    return hooks


def _zeroing(layers: list[int]) -> dict[str, HookFn]:
    return {f"blocks.{layer}.mlp_out": torch.zeros_like for layer in layers}


def evaluate_transcoders(
    options: ReadOptions, *, progress: bool = False, notify: Callable[[str], Any] = print
) -> TranscoderEval:
    """`llmcli sae eval` on a transcoder folder (module doc).

    Raises:
        InputError: a bad folder or run, or ones that do not fit each other; a bad text.
    """
    t0 = time.perf_counter()
    loaded, run = open_transcoder_set(options, notify)
    device = next(run.model.parameters()).device
    figures, label = measured(
        run,
        options,
        device,
        lambda batches: measure_transcoders(loaded, run, batches, progress=progress),
    )
    return TranscoderEval(
        transcoders=str(loaded.folder),
        run=str(run.run_dir),
        layers=loaded.transcoders.layers,
        features=loaded.transcoders.d_transcoder,
        data=label,
        elapsed_s=time.perf_counter() - t0,
        **figures,
    )


def format_transcoder_eval(result: TranscoderEval) -> str:
    """A few lines for people."""
    lines = [
        f"transcoders {result.transcoders}: {result.features:,} features on layers "
        f"{', '.join(map(str, result.layers))} of run {result.run}",
        f"data: {result.data}, {result.tokens:,} tokens",
    ]
    for layer, nmse, l0, dead in zip(
        result.layers, result.nmse, result.l0, result.dead_fraction, strict=True
    ):
        lines.append(f"layer {layer}: normalised MSE {nmse:.4f}, L0 {l0:.2f}, dead {dead:.2%}")
    lines.append(
        f"loss (nats/token), every layer replaced at once: clean {result.ce_clean:.4f}, "
        f"transcoders {result.ce_replaced:.4f}, MLPs zeroed {result.ce_zero:.4f}; "
        f"ce_recovered {result.ce_recovered:.4f}"
    )
    return "\n".join(lines)
