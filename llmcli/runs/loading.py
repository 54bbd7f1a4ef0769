"""Loading a run for readers (`sample`, `inspect-attention`, `eval`, `info`, `export`).

`load_run` reads a run directory's config, tokenizer and weights, checks them against each other
and builds the model in eval mode; with no run directory it picks the latest run. Readers load
`best.safetensors` by default (`weights="last"` picks `model.safetensors`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmcli.config import Config, config_from_dict, read_yaml
from llmcli.data.chat_template import TEMPLATE_FILE
from llmcli.data.tokenizer import Tokenizer, load_tokenizer
from llmcli.errors import CheckpointError, InputError
from llmcli.fileio import near_path, newest
from llmcli.model.gpt import Transformer
from llmcli.runs import versions
from llmcli.runs.directory import BEST_FILE, CONFIG_FILE, META_FILE, MODEL_FILE, TOKENIZER_FILE
from llmcli.runs.formats import load_weights, read_meta, read_weights

TRAIN_HINT = "train one first with `llmcli train tiny` (a shipped config)"


@dataclass
class LoadedRun:
    """A run loaded for reading: the model is in eval mode on the requested device."""

    run_dir: Path
    config: Config
    tokenizer: Tokenizer
    model: Transformer
    step: int
    meta: dict[str, Any] = field(default_factory=dict)
    weights_path: Path | None = None


def run_kind(run_dir: Path) -> str:
    """ "chat" for a run trained on conversations (it holds a chat template), else "text"."""
    return "chat" if (run_dir / TEMPLATE_FILE).is_file() else "text"


def find_latest_run(root: str | Path = Path("checkpoints"), kind: str | None = None) -> Path:
    """The run under `root` (at any depth) whose `model.safetensors` was written most recently;
    with `kind` ("text" or "chat"), the latest of that kind if there is one.

    Raises:
        CheckpointError: no run under `root`, saying how to train one.
    """
    root = Path(root)
    # Runs may sit in sub-folders (--out a/b/run).
    runs = [w.parent for w in root.rglob(MODEL_FILE)] if root.is_dir() else []
    weights = newest(run / MODEL_FILE for run in runs if kind in (None, run_kind(run)))
    weights = weights or newest(run / MODEL_FILE for run in runs)
    if weights is None:
        raise CheckpointError(
            f"no trained run found under '{root}/': {TRAIN_HINT}, or pass --checkpoint DIR "
            "pointing at a run directory."
        )
    return weights.parent


# The kinds of run a command for each kind reads: text is sampled from a chat run too, but a
# chat needs a chat template, which only a chat run holds.
ACCEPTED_KINDS = {None: ("text", "chat"), "text": ("text", "chat"), "chat": ("chat",)}


def run_progress(run_dir: Path) -> str:
    """Where a run got to, from its `meta.json`: ", at step 115 of 2,000 (unfinished)",
    ", at step 2,000", or "" when the run does not say."""
    meta = read_meta(run_dir / META_FILE)
    step, last = meta.get("step"), meta.get("max_steps")
    if step is None:
        return ""
    if last is None or step >= last:
        return f", at step {step:,}"
    return f", at step {step:,} of {last:,} (unfinished)"


def latest_run_notice(
    run_dir: Path, root: str | Path = Path("checkpoints"), kind: str | None = None
) -> str:
    """The line that says which run a command took by default, of which kind and at which
    step, and the newer run it left aside, if any, when the command (for runs of `kind`)
    would take that one too (how to pick it instead)."""
    line = f"using the latest {run_kind(run_dir)} run: {run_dir}{run_progress(run_dir)}"
    newer = find_latest_run(root)
    if newer != run_dir and run_kind(newer) in ACCEPTED_KINDS[kind]:
        line += (
            f" (the newer {run_kind(newer)} run is {newer}{run_progress(newer)}: "
            f"--checkpoint {newer} picks it)"
        )
    return line


def _run_file(run_dir: Path, name: str) -> Path:
    """A file every complete run holds, or a `CheckpointError` that says it is missing."""
    path = run_dir / name
    if not path.is_file():
        raise CheckpointError(
            f"run directory '{run_dir}' has no {name}: it is not a complete llmcli run "
            f"({TRAIN_HINT})."
        )
    return path


def load_config_file(run_dir: Path) -> Config:
    """The run's `config.yaml` as a validated `Config` (named after the run folder)."""
    path = _run_file(run_dir, CONFIG_FILE)
    try:
        return config_from_dict(read_yaml(path), name=run_dir.resolve().name)
    except InputError as exc:
        raise CheckpointError(f"run file '{path}' is not a valid config: {exc}") from None


def load_tokenizer_file(run_dir: Path) -> Tokenizer:
    """The run's `tokenizer.json` as an llmcli tokenizer."""
    path = _run_file(run_dir, TOKENIZER_FILE)
    try:
        return load_tokenizer(path)
    except InputError as exc:
        raise CheckpointError(f"run file '{path}' is not a valid tokenizer: {exc}") from None
    except Exception as exc:  # tokenizers raises plain Exceptions on corrupt JSON
        raise CheckpointError(
            f"run file '{path}' is corrupt or not an llmcli tokenizer ({exc})."
        ) from None


def _check_size(model_config: Any, tensors: dict[str, Any], path: Path) -> None:
    """Compare config.yaml's n_layer, n_embed and learned context length with the weights,
    before building the model: a hand-edited config (n_layer: 100000) fails here at once instead
    of allocating a model that cannot fit.

    Raises:
        CheckpointError: naming the setting, its value and what the weights hold.
    """
    layers = {
        int(name.split(".")[1])
        for name in tensors
        if name.startswith("blocks.") and name.split(".")[1].isdigit()
    }
    held = {"n_layer": max(layers) + 1 if layers else None}
    if "wte.weight" in tensors and tensors["wte.weight"].ndim == 2:
        held["n_embed"] = int(tensors["wte.weight"].shape[1])
    if "wpe.weight" in tensors and tensors["wpe.weight"].ndim == 2:
        held["context_length"] = int(tensors["wpe.weight"].shape[0])
    for key, value in held.items():
        if value is not None and getattr(model_config, key) != value:
            raise CheckpointError(
                f"config.yaml says model.{key} = {getattr(model_config, key)} but the weights "
                f"'{path}' hold {value}: config.yaml was edited or comes from another run; set "
                f"model.{key} back to {value}."
            )


def load_run(
    run_dir: str | Path | None = None,
    *,
    weights: str = "best",
    device: str | torch.device = "cpu",
    notify: Callable[[str], None] | None = None,
    kind: str | None = None,
) -> LoadedRun:
    """Load a run for reading (sampling, inspection, eval): config, tokenizer, model in eval mode.

    Args:
        run_dir: a run directory; None picks `find_latest_run(kind=kind)`. A path to a
            `.safetensors` file inside a run loads that file.
        weights: "best" (`best.safetensors`, falling back to `model.safetensors` if a run has
            no best yet) or "last" (`model.safetensors`).
        device: where to put the model ("cpu", "cuda", "mps").
        notify: called with a line for the user (stderr): which run was picked when `run_dir`
            is None, and a warning for each library whose installed version differs from the
            run's in a way that can change results.
        kind: the kind of run ("text", "chat") the command is for, when `run_dir` is None:
            the latest run of that kind is taken before a newer one of the other kind.

    Raises:
        CheckpointError: a missing, incomplete, corrupt or mismatched run (names the file).
    """
    if run_dir is None:
        run_dir = find_latest_run(kind=kind)
        if notify is not None:
            notify(latest_run_notice(run_dir, kind=kind))
    run = _load_run_files(Path(run_dir), weights, device)
    if notify is not None:
        for line in versions.warnings_for(run.meta.get("versions")):
            notify(f"warning: {line}")
    return run


def run_weights_path(run_dir: Path, weights: str = "best") -> Path:
    """The weights file `weights` ("best" or "last") names in a run directory."""
    if weights not in ("best", "last"):
        raise CheckpointError(f"weights must be 'best' or 'last', not {weights!r}.")
    path = run_dir / (BEST_FILE if weights == "best" else MODEL_FILE)
    if weights == "best" and not path.is_file():
        path = run_dir / MODEL_FILE
    if not path.is_file():
        raise CheckpointError(
            f"run directory '{run_dir}' has no {path.name}: the run has not saved "
            f"weights yet ({TRAIN_HINT})."
        )
    return path


def _load_run_files(run_dir: Path, weights: str, device: str | torch.device) -> LoadedRun:
    weights_path: Path | None = None
    if run_dir.is_file() and run_dir.suffix == ".safetensors":
        weights_path, run_dir = run_dir, run_dir.parent
    if not run_dir.exists():
        near = near_path(run_dir)
        hint = f"did you mean '{near}'? Or " if near is not None else ""
        raise CheckpointError(
            f"run directory '{run_dir}' does not exist: {hint}{TRAIN_HINT}, or check the path."
        )
    if not run_dir.is_dir():
        raise CheckpointError(
            f"checkpoint '{run_dir}' is a file, not a run directory: pass the folder that holds "
            f"{CONFIG_FILE}, {TOKENIZER_FILE} and {MODEL_FILE}."
        )
    if weights_path is None:
        weights_path = run_weights_path(run_dir, weights)

    config = load_config_file(run_dir)
    tokenizer = load_tokenizer_file(run_dir)
    tensors, metadata = read_weights(weights_path)
    vocab = int(tokenizer.vocab_size)
    saved_vocab = metadata.get("vocab_size")
    if saved_vocab is not None and saved_vocab.isdigit() and int(saved_vocab) != vocab:
        raise CheckpointError(
            f"tokenizer '{run_dir / TOKENIZER_FILE}' has {vocab} tokens but the weights "
            f"'{weights_path}' were trained with {saved_vocab}: the files come from different "
            "runs."
        )
    _check_size(config.model, tensors, weights_path)
    try:
        model = Transformer(config.model, vocab)
    except InputError as exc:
        raise CheckpointError(f"cannot build the model of '{run_dir}': {exc}") from None
    try:
        load_weights(model, tensors, weights_path)
    except CheckpointError as exc:
        if saved_vocab is None:
            raise CheckpointError(
                f"{exc} (does tokenizer '{run_dir / TOKENIZER_FILE}', with {vocab} tokens, "
                "belong to these weights?)"
            ) from None
        raise
    model.to(device)
    model.eval()
    step_text = metadata.get("step", "0")
    step = int(step_text) if step_text.isdigit() else 0
    return LoadedRun(
        run_dir=run_dir,
        config=config,
        tokenizer=tokenizer,
        model=model,
        step=step,
        meta=read_meta(run_dir / META_FILE),
        weights_path=weights_path,
    )
