"""`llmcli sae train`: a sparse autoencoder trained on a hook point of a run, as its own training
data streams through the model.

Each step draws random windows of the run's training split (`BatchSampler`, its own seed), runs
the model up to the hook point only (`points.read_activations`), and takes one Adam step of the
SAE on those activations: no activation is stored beyond the step that uses it. The loss is the
reconstruction's squared error (summed over channels, averaged over tokens) plus AuxK
(`model.auxk_loss`, weight `aux_coef`): the features that have not fired for
`dead_tokens` tokens reconstruct what the live ones missed, which gives them a gradient back to
life. Dead features are counted, not resampled: `dead_fraction` in `metrics.jsonl` and in `sae
eval` is the share of features that have not fired for `dead_tokens` tokens (in eval: on any
token scored). The decoder rows are kept at unit norm (the gradient along a row is dropped
before the step, the row rescaled after). The learning rate is constant, then decays linearly
over the last fifth of the steps, to 0 at the last step.

A save writes the SAE (SAELens's format, `llmcli.inspection.sae.folder`), then the resume state
(`llmcli.inspection.sae.state`) last: every `save_interval` steps, at the end, and at Ctrl-C.
`--resume` goes on from it exactly. Threads and device are chosen as `train` chooses them
(`train.threads` of the run unless `--threads`; `--device`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmcli.data.batches import BatchSampler
from llmcli.data.tokens import prepare_data
from llmcli.device import check_threads, resolve_device
from llmcli.errors import InputError
from llmcli.fileio import remove_stale_temp_files
from llmcli.inspection.sae.config import SAEConfig
from llmcli.inspection.sae.folder import CFG_FILE, STATE_FILE, SAEInfo, save_sae
from llmcli.inspection.sae.loop import Training, TrainSummary, Wording, start, train_in_folder
from llmcli.inspection.sae.loop import lr_at as lr_at  # where it was, for its users
from llmcli.inspection.sae.model import SparseAutoencoder, auxk_loss
from llmcli.inspection.sae.points import check_hook, read_activations
from llmcli.runs.loading import LoadedRun, load_run

logger = logging.getLogger(__name__)

#: Features per channel of the hook point when `--features` is not given.
DEFAULT_EXPANSION = 16


@dataclass(frozen=True)
class TrainOptions:
    """Where `train_sae` reads and writes, besides what it trains (`SAEConfig`).

    Attributes:
        checkpoint: the run (None: the latest under `checkpoints/`).
        out: the SAE folder (None: `<run>/sae/<hook>/`).
        resume: go on from the folder's `state.pt`.
        overwrite: start afresh in a folder that holds an SAE (its files are replaced).
        weights: the run's "best" or "last" weights.
        device: "auto", "cpu", "cuda" or "mps".
        threads: CPU threads (None: the run's `train.threads`).
    """

    checkpoint: str | Path | None = None
    out: str | Path | None = None
    resume: bool = False
    overwrite: bool = False
    weights: str = "best"
    device: str = "auto"
    threads: int | None = None

    def __post_init__(self) -> None:
        check_threads(self.threads)
        if self.resume and self.overwrite:
            raise InputError(
                "--resume goes on with the saved SAE and --overwrite replaces it: give one of them."
            )


def sae_step(
    sae: SparseAutoencoder,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    dead: torch.Tensor,
    aux_coef: float,
    lr: float,
) -> dict[str, Any]:
    """One optimizer step of `sae` on the activations `x` `(N, d_in)`.

    Args:
        dead: `(F,)` bool, the features counted dead (AuxK trains them on the residual).
        aux_coef: AuxK's weight.
        lr: this step's learning rate.

    Returns:
        The step's figures: `mse` (summed over channels, mean over rows), `fvu` (the share of
        the variance left unexplained), `l0` (features active per row), `aux` (AuxK's loss),
        and `fired` (`(F,)` bool: the features active on any row).
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    N = x.shape[0]
    pre = sae.pre_acts(x)  # (N, F)
    rows, features, values = sae.select(pre)
    x_hat = sae.decode_sparse(rows, features, values, N)  # (N, d_in)
    mse = (x_hat - x).pow(2).sum(-1).mean()
    loss, aux = mse, torch.zeros(())
    n_dead = int(dead.sum())
    if n_dead and aux_coef > 0:
        aux, scale = auxk_loss(sae, pre, dead, (x - x_hat).detach())
        loss = loss + aux_coef * scale * aux
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    sae.remove_parallel_grad_()
    optimizer.step()
    sae.normalize_decoder_()
    active = values > 0
    if sae.activation == "batchtopk":
        sae.update_threshold(values)
    with torch.no_grad():
        variance = (x - x.mean(0)).pow(2).sum(-1).mean()
    fired = torch.zeros(sae.d_sae, dtype=torch.bool, device=x.device)
    fired[features[active]] = True
    return {
        "mse": mse.item(),
        "fvu": (mse / variance).item(),
        "l0": active.sum().item() / N,
        "aux": aux.item(),
        "fired": fired,
    }


def train_sae(
    config: SAEConfig,
    options: TrainOptions = TrainOptions(),
    *,
    progress: bool = False,
    notify: Callable[[str], Any] = logger.warning,
) -> TrainSummary:
    """Train (or go on training) a sparse autoencoder on a hook point of a run.

    Raises:
        InputError: a bad run, hook point or setting; a folder that holds an SAE without
            `--resume` or `--overwrite`; a resume whose settings or run differ from the saved.
    """
    device = resolve_device(options.device, what="--device")
    run = load_run(options.checkpoint, weights=options.weights, device=device, notify=notify)
    folder = sae_folder(run, config.hook, options.out)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--out '{folder}' is a file: give a folder for the SAE.")
    claim = (
        f"the SAE folder '{folder}'",
        "Wait for it to end (Ctrl-C saves its state) and go on with --resume, or "
        "write this SAE elsewhere with --out DIR.",
    )
    threads = options.threads or run.config.train.threads

    def build() -> Training:
        return _build(config, options, run, folder, device, notify)

    return train_in_folder(folder, claim, threads, build, progress)


def sae_folder(run: LoadedRun, hook: str, out: str | Path | None) -> Path:
    """The SAE folder: `out`, else `<run>/sae/<hook>/`."""
    return Path(out) if out is not None else run.run_dir / "sae" / hook


def _build(
    config: SAEConfig,
    options: TrainOptions,
    run: LoadedRun,
    folder: Path,
    device: torch.device,
    notify: Callable[[str], Any],
) -> Training:
    """The SAE in `folder` (claimed), its optimizer and the window stream, fresh or restored
    from `state.pt`."""
    model = run.model
    d_in = check_hook(model, config.hook)
    features = config.features or DEFAULT_EXPANSION * d_in
    config = dataclasses.replace(config, features=features)  # checks k <= features
    check_folder(folder, options)
    ctx = model.context_length
    data = prepare_data(run.config.data, ctx, tokenizer=run.tokenizer)
    windows = math.ceil(config.batch_tokens / ctx)
    sampler = BatchSampler(data.train, windows, ctx, config.seed, device=device)
    generator = torch.Generator().manual_seed(config.seed)
    sae = SparseAutoencoder(d_in, features, config.k, config.activation, generator=generator)
    sae.to(device).train()
    trainee = _SAETrainee(sae, config, run)
    return start(config, run, folder, trainee, sampler, (features,), options.resume, notify)


def check_folder(folder: Path, options: TrainOptions, config_file: str = CFG_FILE) -> None:
    """A fresh start needs a folder without an SAE (or --overwrite); a resume, a state.
    `config_file` is what a saved one holds beside `state.pt` (transcoders: `config.yaml`)."""
    held = [name for name in (config_file, STATE_FILE) if (folder / name).is_file()]
    if options.resume and not (folder / STATE_FILE).is_file():
        raise InputError(
            f"--resume: '{folder}' holds no {STATE_FILE} to go on from; leave out --resume to "
            "train one."
        )
    if held and not (options.resume or options.overwrite):
        raise InputError(
            f"'{folder}' already holds an SAE ({', '.join(held)}): --resume goes on training "
            "it, --overwrite trains a new one in its place, --out DIR writes elsewhere."
        )
    remove_stale_temp_files(folder)


class _SAETrainee:
    """An SAE on a hook point, for `loop`: its step on a batch, its folder in SAELens's format."""

    kind = "sae"
    desc = "sae train"
    wording = Wording(
        resuming="resuming the SAE in {folder} at step {step}",
        stale_run="the SAE was trained on run '{run}' at step {run_step}, and the run loaded "
        "('{run_dir}') is at step {step}: its activations have changed; train a new SAE "
        "(--overwrite).",
        misfit="the SAE resume state does not fit this SAE ({exc}).",
        saved="the SAE in '{folder}' is saved",
    )

    def __init__(self, sae: SparseAutoencoder, config: SAEConfig, run: LoadedRun) -> None:
        self.modules = self.sae = sae
        self.config, self.run = config, run

    def step(
        self,
        x: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        dead: torch.Tensor,
        lr: float,
        first: bool,
    ) -> dict[str, Any]:
        """`sae_step` on the hook point's activations of the windows `x` `(B, T)`."""
        acts = read_activations(self.run.model, self.config.hook, x)  # (B * T, d_in)
        if first:  # start the decoder bias at the activations' mean
            with torch.no_grad():
                self.sae.b_dec.copy_(acts.mean(0))
        return sae_step(self.sae, optimizer, acts, dead, self.config.aux_coef, lr)

    def save(self, folder: Path, step: int, tokens: int) -> None:
        config, run = self.config, self.run
        info = SAEInfo(config.hook, str(run.run_dir), config.to_dict(), step, tokens)
        save_sae(folder, self.sae, info, run.model.context_length)
