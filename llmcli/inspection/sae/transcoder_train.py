"""`llmcli sae train --kind transcoder`: a transcoder per layer, trained as the run's own training
data streams through the model.

Each step draws random windows of the run's training split (`BatchSampler`, its own seed), runs
the model up to the last layer trained (`points.read_points`), and, for every layer at once,
reads the MLP's input (`blocks.{l}.mlp_in`) and output (`blocks.{l}.mlp_out`): each layer's
transcoder predicts the output from the input, and one Adam step takes the sum of their losses
(the layers share no parameter, so this is each layer's own step). A layer's loss is the squared
error of the prediction (summed over channels, averaged over tokens), plus relu's or tanh's
sparsity penalty (weight `sparsity_coef`), or, for topk and batchtopk, AuxK on the features dead
for `dead_tokens` tokens (`model.auxk_loss`, weight `aux_coef`). The learning rate is
`loop.lr_at`'s, as for an SAE.

A save writes the set in circuit-tracer's layout (`transcoder_folder`), then the resume state
(`SAEState`, the set's state dict in its `sae`) last: every `save_interval` steps, at the end
and at Ctrl-C. `--resume` goes on from it exactly. The folder claim, the stop request and the
figures logged are those of an SAE's training (`loop`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmcli.data.batches import BatchSampler
from llmcli.data.tokens import prepare_data
from llmcli.device import resolve_device
from llmcli.errors import InputError
from llmcli.inspection.sae.config import SAEConfig
from llmcli.inspection.sae.loop import Training, TrainSummary, Wording, start, train_in_folder
from llmcli.inspection.sae.model import auxk_loss
from llmcli.inspection.sae.points import read_points
from llmcli.inspection.sae.train import DEFAULT_EXPANSION, TrainOptions, check_folder
from llmcli.inspection.sae.transcoder import Transcoder, TranscoderSet
from llmcli.inspection.sae.transcoder_folder import (
    CONFIG_FILE,
    TranscoderInfo,
    save_transcoders,
)
from llmcli.runs.loading import LoadedRun, load_run

logger = logging.getLogger(__name__)


def parse_layers(layers: str, n_layer: int) -> list[int]:
    """`--layers`: "all", or block indices joined by commas, each in `0..n_layer - 1`.

    Raises:
        InputError: an index that is not a whole number or not a layer of the run.
    """
    if layers.strip() == "all":
        return list(range(n_layer))
    try:
        chosen = sorted({int(part) for part in layers.split(",")})
    except ValueError:
        chosen = []
    if not chosen or chosen[0] < 0 or chosen[-1] >= n_layer:
        raise InputError(
            f"--layers ({layers!r}) must be all, or layers of the run joined by commas, each in "
            f"0..{n_layer - 1}."
        )
    return chosen


def transcoder_step(
    transcoders: TranscoderSet,
    optimizer: torch.optim.Optimizer,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    dead: torch.Tensor,
    config: SAEConfig,
    lr: float,
) -> dict[str, Any]:
    """One optimizer step of every layer's transcoder.

    Args:
        pairs: per layer, the MLP's input and output rows, each `(N, C)`.
        dead: `(L, F)` bool, the features counted dead.
        config: the loss weights (`aux_coef`, `sparsity_coef`).
        lr: this step's learning rate.

    Returns:
        The means over layers of `mse`, `fvu`, `l0`, `aux` (AuxK's or the penalty's loss), and
        `fired` (`(L, F)` bool).
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = torch.zeros(())
    figures = {"mse": 0.0, "fvu": 0.0, "l0": 0.0, "aux": 0.0}
    fired = torch.zeros_like(dead)
    kept = []
    for i, (tc, (x, y)) in enumerate(zip(transcoders.transcoders, pairs, strict=True)):
        y_hat, pre, features, values = tc.training_output(x)  # (N, C), (N, F), (M,), (M,)
        mse = (y_hat - y).pow(2).sum(-1).mean()
        extra = config.sparsity_coef * tc.penalty(pre)
        n_dead = int(dead[i].sum())
        if tc.activation in ("topk", "batchtopk") and n_dead and config.aux_coef > 0:
            aux, scale = auxk_loss(tc, pre, dead[i], (y - y_hat).detach())  # as an SAE's
            extra = config.aux_coef * scale * aux
        loss = loss + mse + extra
        active = values > 0
        fired[i, features[active]] = True
        kept.append(values)
        with torch.no_grad():
            variance = (y - y.mean(0)).pow(2).sum(-1).mean()
        figures["mse"] += mse.item()
        figures["fvu"] += (mse / variance).item()
        figures["l0"] += active.sum().item() / len(x)
        figures["aux"] += float(extra.detach())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    for tc, values in zip(transcoders.transcoders, kept, strict=True):
        if tc.activation == "batchtopk":
            tc.update_threshold(values)
    n = len(pairs)
    return {key: value / n for key, value in figures.items()} | {"fired": fired}


def train_transcoders(
    config: SAEConfig,
    options: TrainOptions = TrainOptions(),
    *,
    progress: bool = False,
    notify: Callable[[str], Any] = logger.warning,
) -> TrainSummary:
    """Train (or go on training) a transcoder set on a run (`config.kind == "transcoder"`).

    Raises:
        InputError: a bad run, layer or setting; a folder that holds a set without `--resume` or
            `--overwrite`; a resume whose settings or run differ from the saved.
    """
    device = resolve_device(options.device, what="--device")
    run = load_run(options.checkpoint, weights=options.weights, device=device, notify=notify)
    folder = Path(options.out) if options.out is not None else run.run_dir / "transcoders"
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--out '{folder}' is a file: give a folder for the transcoders.")
    layers = parse_layers(config.layers or "all", run.model.n_layer)
    claim = (
        f"the transcoder folder '{folder}'",
        "Wait for it to end (Ctrl-C saves its state) and go on with --resume, or "
        "write these transcoders elsewhere with --out DIR.",
    )
    threads = options.threads or run.config.train.threads

    def build() -> Training:
        return _build(config, options, run, folder, layers, device, notify)

    return train_in_folder(folder, claim, threads, build, progress)


def _build(
    config: SAEConfig,
    options: TrainOptions,
    run: LoadedRun,
    folder: Path,
    layers: list[int],
    device: torch.device,
    notify: Callable[[str], Any],
) -> Training:
    """The set in `folder` (claimed), its optimizer and the window stream, fresh or restored."""
    model = run.model
    C = model.n_embed
    features = config.features or DEFAULT_EXPANSION * C
    config = dataclasses.replace(config, features=features)  # checks k <= features
    check_folder(folder, options, CONFIG_FILE)
    ctx = model.context_length
    data = prepare_data(run.config.data, ctx, tokenizer=run.tokenizer)
    windows = math.ceil(config.batch_tokens / ctx)
    sampler = BatchSampler(data.train, windows, ctx, config.seed, device=device)
    generator = torch.Generator().manual_seed(config.seed)
    transcoders = TranscoderSet(
        layers,
        [
            Transcoder(C, features, config.k, config.activation, config.skip, generator=generator)
            for _ in layers
        ],
    )
    transcoders.to(device).train()
    trainee = _TranscoderTrainee(transcoders, config, run)
    fired_shape = (len(layers), features)
    return start(config, run, folder, trainee, sampler, fired_shape, options.resume, notify)


class _TranscoderTrainee:
    """A transcoder set, for `loop`: its step on a batch, its folder in circuit-tracer's layout."""

    kind = "transcoder"
    desc = "transcoders"
    wording = Wording(
        resuming="resuming the transcoders in {folder} at step {step}",
        stale_run="the transcoders were trained on run '{run}' at step {run_step}, and the run "
        "loaded ('{run_dir}') is at step {step}: its activations have changed; train new ones "
        "(--overwrite).",
        misfit="the transcoder resume state does not fit ({exc}).",
        saved="the transcoders in '{folder}' are saved",
    )

    def __init__(self, transcoders: TranscoderSet, config: SAEConfig, run: LoadedRun) -> None:
        self.modules = self.transcoders = transcoders
        self.config, self.run = config, run
        ends = ("in", "out")
        self.names = [f"blocks.{layer}.mlp_{end}" for layer in transcoders.layers for end in ends]

    def step(
        self,
        x: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        dead: torch.Tensor,
        lr: float,
        first: bool,
    ) -> dict[str, Any]:
        """`transcoder_step` on every layer's MLP input and output of the windows `x` `(B, T)`."""
        names, transcoders = self.names, self.transcoders
        rows = read_points(self.run.model, names, x)  # each (B * T, C)
        pairs = [(rows[a], rows[b]) for a, b in zip(names[::2], names[1::2], strict=True)]
        if first:  # start each decoder bias at its output's mean
            with torch.no_grad():
                for tc, (_, y) in zip(transcoders.transcoders, pairs, strict=True):
                    tc.b_dec.copy_(y.mean(0))
        return transcoder_step(transcoders, optimizer, pairs, dead, self.config, lr)

    def save(self, folder: Path, step: int, tokens: int) -> None:
        config, run = self.config, self.run
        info = TranscoderInfo(str(run.run_dir), config.to_dict(), run.step, step, tokens)
        save_transcoders(folder, self.transcoders, info)
