"""The run directory: atomic saves, safe loads, validation, finding the latest run.

A run directory (`checkpoints/<config name>/` by default) holds:

| file | written | what it is |
| --- | --- | --- |
| `config.yaml` | once, at the start | the fully resolved config that produced the run |
| `tokenizer.json` | once, at the start | the tokenizer: enough to encode and decode alone |
| `model.safetensors` | every save | the weights at the last save (evaluation, end, Ctrl-C) |
| `best.safetensors` | when val improves | the weights with the lowest val loss so far |
| `meta.json` | every save | step, tokens, elapsed time, val losses, library versions |
| `state.pt` | every save, last | resume state: weights, optimizer, schedule step, RNG and |
| | | batch-sampler states; read with `torch.load(weights_only=True)` |
| `metrics.jsonl` | every log step | one JSON object per logged step and per evaluation |
| `loss.png` | every evaluation | train and val loss against steps |

Readers (`sample`, `inspect-attention`) load `best.safetensors` by default (`weights="last"`
picks `model.safetensors`). Weights are safetensors, and the resume state is loaded with
`weights_only=True`: loading a run never runs code from it.

Every file is written to a temporary name in the same folder, flushed to disk (fsync) and renamed
into place (`os.replace`), so a crash at any instant leaves either the old or the new file, never a
half-written one. `state.pt` is written last at each save and holds its own copy of the weights:
it is the commit point of a save, and resuming needs nothing else, so a run killed between two
files of a save still resumes exactly from the previous save.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, save

from llmcli.config import Config, config_from_dict, dump_yaml, read_yaml
from llmcli.data.tokenizer import Tokenizer, load_tokenizer
from llmcli.errors import CheckpointError, InputError, describe_os_error
from llmcli.fileio import atomic_write_bytes, atomic_write_json, atomic_write_text
from llmcli.model.gpt import Transformer
from llmcli.runs import versions

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
MODEL_FILE = "model.safetensors"
BEST_FILE = "best.safetensors"
META_FILE = "meta.json"
STATE_FILE = "state.pt"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"

WEIGHTS_FORMAT = "llmcli-1"
TRAIN_HINT = "train one first with `llmcli train configs/tiny.yaml` (or `llmcli train tiny`)"


def atomic_torch_save(path: str | Path, obj: Any) -> None:
    """`torch.save` through `atomic_write_bytes` (plain tensors and containers only)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def ensure_run_dir(run_dir: str | Path) -> Path:
    """Create `run_dir` (and parents) and check that files can be written there.

    Raises:
        CheckpointError: the folder cannot be created or written (names it and the reason).
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise CheckpointError(
            f"output path '{run_dir}' exists and is not a directory: choose another --out "
            "or remove that file."
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(run_dir / ".write-test", b"")
        (run_dir / ".write-test").unlink()
    except OSError as exc:
        raise CheckpointError(
            f"cannot write to output directory '{run_dir}': {exc.strerror or exc}. "
            "Choose a writable folder with --out DIR (or train.out_dir)."
        ) from None
    return run_dir


# ---------------------------------------------------------------------------------------------
# Weights (safetensors)
# ---------------------------------------------------------------------------------------------


def unique_state_dict(model: Any) -> dict[str, Any]:
    """The model's state dict with tied tensors (same storage) kept once, contiguous, on CPU.

    safetensors refuses tensors that share memory (tied embedding / LM head); the first name
    keeps the tensor and `load_weights` restores the alias through the model itself.
    """
    out: dict[str, Any] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() > 0 and key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def weights_bytes(model: Any, metadata: dict[str, Any]) -> bytes:
    """Serialize `model`'s weights to safetensors bytes with string `metadata`."""
    meta = {"format": WEIGHTS_FORMAT, **{k: str(v) for k, v in metadata.items()}}
    return save(unique_state_dict(model), metadata=meta)


def read_weights(path: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Read a safetensors file into CPU tensors and its metadata, refusing anything else.

    Raises:
        CheckpointError: missing, not safetensors (a pickle, say), truncated or corrupt.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"weights file '{path}' is missing.") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read weights file '{path}': {exc.strerror}.") from None
    header = _safetensors_header(path, data)
    try:
        tensors = load(data)
    except Exception as exc:  # safetensors raises its own error types for bad buffers
        raise CheckpointError(
            f"weights file '{path}' is corrupt or truncated ({exc}); retrain, or use the "
            "other weights file of the run (--weights last / best)."
        ) from None
    metadata = header.get("__metadata__") or {}
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def _safetensors_header(path: Path, data: bytes) -> dict[str, Any]:
    # A safetensors file starts with an 8-byte little-endian header length and a JSON header.
    # Checking it first turns pickles and other foreign files into a clear message.
    not_st = (
        f"weights file '{path}' is not a safetensors file (a pickle or other format?); "
        "llmcli only loads safetensors weights, which cannot run code."
    )
    if len(data) < 8:
        raise CheckpointError(f"weights file '{path}' is truncated ({len(data)} bytes).")
    (n,) = struct.unpack("<Q", data[:8])
    if n < 2 or n > 100_000_000 or data[8:9] != b"{":
        raise CheckpointError(not_st)
    if 8 + n > len(data):
        raise CheckpointError(
            f"weights file '{path}' is truncated: its header says {n} bytes but the file has "
            f"{len(data)} in all."
        )
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError:
        raise CheckpointError(not_st) from None
    if not isinstance(header, dict):
        raise CheckpointError(not_st)
    ends = [
        v["data_offsets"][1]
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v
    ]
    if ends and 8 + n + max(ends) > len(data):
        raise CheckpointError(
            f"weights file '{path}' is truncated: {len(data)} bytes, {8 + n + max(ends)} expected."
        )
    return header


def load_weights(model: Any, tensors: dict[str, Any], path: str | Path) -> None:
    """Load `tensors` into `model`, checking names and shapes; tied aliases may be absent.

    Raises:
        CheckpointError: a tensor is missing, unexpected or of the wrong shape (names it).
    """
    path = Path(path)
    expected = model.state_dict()
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"weights file '{path}' has tensors the model does not: {', '.join(unexpected[:5])}"
            f"{' ...' if len(unexpected) > 5 else ''}; the weights do not match config.yaml."
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"weights file '{path}': tensor '{name}' has shape {tuple(tensor.shape)} but "
                f"the model in config.yaml needs {tuple(expected[name].shape)}."
            )
    # A name may be missing only if it aliases (shares storage with) a tensor that is present.
    by_storage: dict[int, list[str]] = {}
    for name, tensor in expected.items():
        by_storage.setdefault(tensor.data_ptr(), []).append(name)
    missing = [
        name
        for name in expected
        if name not in tensors
        and not any(alias in tensors for alias in by_storage[expected[name].data_ptr()])
    ]
    if missing:
        raise CheckpointError(
            f"weights file '{path}' lacks tensors {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; it is incomplete or from another model."
        )
    with torch.no_grad():
        model.load_state_dict(tensors, strict=False)


# ---------------------------------------------------------------------------------------------
# Resume state (torch.load with weights_only=True)
# ---------------------------------------------------------------------------------------------


def save_state(run_dir: str | Path, state: dict[str, Any]) -> None:
    """Atomically write the resume state (plain tensors, numbers, strings and containers)."""
    atomic_torch_save(Path(run_dir) / STATE_FILE, state)


def load_state(run_dir: str | Path) -> dict[str, Any]:
    """Read the resume state safely (`weights_only=True`: no code runs).

    Raises:
        CheckpointError: missing, unsafe (arbitrary pickled objects), truncated or corrupt.
    """
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(
            f"no resume state '{path}': nothing to resume in '{run_dir}'. Start a new run "
            "without --resume."
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            raise CheckpointError(
                f"resume state '{path}' holds Python objects other than tensors and plain "
                "data; it was refused unread (loading it could run code). It was not written "
                "by llmcli: remove it to start afresh."
            ) from None
        raise CheckpointError(f"resume state '{path}' is corrupt or truncated ({exc}).") from None
    except Exception as exc:  # a damaged file fails in many ways (zip, pickle, EOF, storage)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        size = path.stat().st_size
        raise CheckpointError(
            f"resume state '{path}' is corrupt or truncated ({size} bytes; {reason}). Remove "
            "it to start afresh, or restore it from a backup."
        ) from None
    if not isinstance(state, dict) or state.get("format") != WEIGHTS_FORMAT:
        raise CheckpointError(
            f"resume state '{path}' is not an llmcli resume state (format "
            f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r})."
        )
    return state


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------


def read_meta(run_dir: str | Path) -> dict[str, Any]:
    """`meta.json` of a run as a dict ({} when absent or unreadable: it is informative only)."""
    path = Path(run_dir) / META_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def write_config_and_tokenizer(run_dir: Path, config: Config, tokenizer: Tokenizer) -> None:
    """Write `config.yaml` and `tokenizer.json` atomically."""
    atomic_write_text(run_dir / CONFIG_FILE, dump_yaml(config))
    atomic_write_text(run_dir / TOKENIZER_FILE, tokenizer.to_json())


def save_model_run(
    run_dir: str | Path,
    config: Config,
    tokenizer: Tokenizer,
    model: Transformer,
    *,
    extra_meta: dict[str, Any] | None = None,
) -> None:
    """Write a complete readable run (no resume state): config, tokenizer, weights, meta.

    `model.safetensors` and `best.safetensors` both get the given weights. Used to package a
    model without training (tests of the readers, imported weights).

    Args:
        run_dir: the folder to write (created if needed).
        config: the config that describes `model`.
        tokenizer: an llmcli tokenizer (has `.to_json()` and `.vocab_size`).
        model: a `Transformer` built from `config.model`.
        extra_meta: merged into `meta.json` (for example `{"step": 100}`).
    """
    run_dir = ensure_run_dir(run_dir)
    meta = {"step": 0, "vocab_size": int(tokenizer.vocab_size), "versions": versions.record()}
    meta.update(extra_meta or {})
    write_config_and_tokenizer(run_dir, config, tokenizer)
    data = weights_bytes(model, {"step": meta["step"], "vocab_size": meta["vocab_size"]})
    atomic_write_bytes(run_dir / MODEL_FILE, data)
    atomic_write_bytes(run_dir / BEST_FILE, data)
    atomic_write_json(run_dir / META_FILE, meta)


def save_checkpoint(
    run_dir: str | Path,
    model: Any,
    state: dict[str, Any],
    meta: dict[str, Any],
    *,
    best: bool,
    previous_step: int = -1,
) -> None:
    """One save of a training run: weights, best weights (if `best`), meta, then resume state.

    `state.pt` is written last: it is the commit point. A crash before it leaves the previous
    resume state, which holds its own weights, so resuming is exact either way.

    Args:
        run_dir: the run directory (exists, with config.yaml and tokenizer.json).
        model: the unwrapped model (its weights go to `model.safetensors`).
        state: the resume state (must include "model", the weights as a state dict).
        meta: the `meta.json` content (must include "step" and "vocab_size").
        best: also write the weights to `best.safetensors`.
        previous_step: the step of the previous save (-1: none), named if this one fails.

    Raises:
        CheckpointError: a write failed (the file being written keeps its previous content);
            the message names the reason and the previous checkpoint, which is intact.
    """
    run_dir = Path(run_dir)
    try:
        data = weights_bytes(model, {"step": meta["step"], "vocab_size": meta["vocab_size"]})
        atomic_write_bytes(run_dir / MODEL_FILE, data)
        if best:
            atomic_write_bytes(run_dir / BEST_FILE, data)
        atomic_write_json(run_dir / META_FILE, meta)
        save_state(run_dir, {"format": WEIGHTS_FORMAT, **state})
    except OSError as exc:
        previous = f"step {previous_step}" if previous_step >= 0 else "none yet"
        raise CheckpointError(
            f"could not save the checkpoint of step {meta['step']} in '{run_dir}': "
            f"{describe_os_error(exc)}. The previous checkpoint ({previous}) is "
            "intact; fix the problem and continue with --resume."
        ) from None


# ---------------------------------------------------------------------------------------------
# A training run's directory
# ---------------------------------------------------------------------------------------------

_RUN_FILES = (
    MODEL_FILE,
    BEST_FILE,
    STATE_FILE,
    META_FILE,
    METRICS_FILE,
    PLOT_FILE,
)


def default_run_dir(config: Config) -> Path:
    """`train.out_dir`, else `checkpoints/<config file stem>`."""
    return Path(config.train.out_dir) if config.train.out_dir else Path("checkpoints") / config.name


def resumes(run_dir: Path, resume: bool | str) -> bool:
    """Whether a start continues the run in `run_dir`: `resume` is True, or "auto" and the
    folder holds a resume state (what else it holds is checked as for a fresh start)."""
    return resume is True or (resume == "auto" and (run_dir / STATE_FILE).is_file())


def prepare_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Check the run directory can be written and holds what `resume` / `overwrite` expect.

    A fresh start (`overwrite`, or a folder without a run) removes the files of an earlier run.

    Raises:
        CheckpointError: nothing to resume, a run already there, or an unwritable folder.
    """
    state = run_dir / STATE_FILE
    if resume:
        if not state.is_file():
            raise CheckpointError(
                f"--resume: nothing to resume in '{run_dir}' (no {STATE_FILE}; a run saves "
                "one at its first evaluation). Start it without --resume."
            )
        ensure_run_dir(run_dir)
        return
    ensure_run_dir(run_dir)
    if not overwrite and (state.exists() or (run_dir / MODEL_FILE).exists()):
        meta = read_meta(run_dir)
        at = f" (step {meta['step']})" if "step" in meta else ""
        raise CheckpointError(
            f"'{run_dir}' already holds a run{at}: continue it with --resume, start it afresh "
            "with --overwrite, or write elsewhere with --out DIR."
        )
    for name in _RUN_FILES:
        with contextlib.suppress(FileNotFoundError):
            (run_dir / name).unlink()


# What `save` writes into the resume state, by type: checked before any of it is used.
_STATE_LAYOUT: dict[str, type | tuple[type, ...]] = {
    "config": dict,
    "model": dict,
    "optimizer": dict,
    "rng": list,
    "sampler": list,
    "step": int,
    "tokens": int,
    "elapsed_s": (int, float),
    "metrics_bytes": int,
}


def check_resumable(state: dict[str, Any], config: Config, run_dir: Path, vocab: int) -> None:
    """Refuse a resume state that is malformed or does not fit `config` and the tokenizer.

    Raises:
        CheckpointError: naming what is missing or what differs, and what to do.
    """
    bad = [k for k, kind in _STATE_LAYOUT.items() if not isinstance(state.get(k), kind)]
    if not bad and not (
        state["rng"]
        and len(state["rng"]) == len(state["sampler"])
        and all(isinstance(x, dict) for x in state["rng"] + state["sampler"])
    ):
        bad = ["rng", "sampler"]
    if bad:
        raise CheckpointError(
            f"resume state '{run_dir / STATE_FILE}' is incomplete or malformed (missing or "
            f"wrong: {', '.join(bad)}); it was not written by this version of llmcli. Remove "
            "it to start afresh, or restore it from a backup."
        )
    saved_optimizer = state["config"].get("train", {}).get("optimizer", "adamw")
    if saved_optimizer != config.train.optimizer:
        raise CheckpointError(
            f"cannot resume '{run_dir}' with train.optimizer={config.train.optimizer!r}: it was "
            f"trained with {saved_optimizer!r}, whose saved state does not carry over. Resume "
            f"with --set train.optimizer={saved_optimizer}, or start a new run with --out DIR."
        )
    saved = state["config"].get("model", {})
    now = config.to_dict()["model"]
    diff = [
        f"model.{k}: saved {saved.get(k)!r}, config {v!r}"
        for k, v in now.items()
        if saved.get(k) != v
    ]
    if diff:
        raise CheckpointError(
            f"cannot resume '{run_dir}': the config's model differs from the saved one "
            f"({'; '.join(diff)}). Resume with the run's own config ({run_dir / CONFIG_FILE}) "
            "or start a new run with --out DIR."
        )
    if state.get("vocab_size") != vocab:
        raise CheckpointError(
            f"cannot resume '{run_dir}': its tokenizer has {vocab} tokens but the saved model "
            f"has {state.get('vocab_size')}; the run's files come from different runs."
        )


# ---------------------------------------------------------------------------------------------
# Reading a run
# ---------------------------------------------------------------------------------------------


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


def find_latest_run(root: str | Path = Path("checkpoints")) -> Path:
    """The run under `root` (at any depth) whose `model.safetensors` was written most recently.

    Raises:
        CheckpointError: no run under `root`, saying how to train one.
    """
    root = Path(root)
    runs = []
    if root.is_dir():
        for weights in root.rglob(MODEL_FILE):  # runs may sit in sub-folders (--out a/b/run)
            if weights.is_file():
                runs.append((weights.stat().st_mtime_ns, str(weights.parent), weights.parent))
    if not runs:
        raise CheckpointError(
            f"no trained run found under '{root}/': {TRAIN_HINT}, or pass --checkpoint DIR "
            "pointing at a run directory."
        )
    return max(runs)[2]


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
) -> LoadedRun:
    """Load a run for reading (sampling, inspection, eval): config, tokenizer, model in eval mode.

    Args:
        run_dir: a run directory; None picks `find_latest_run()`. A path to a `.safetensors`
            file inside a run loads that file.
        weights: "best" (`best.safetensors`, falling back to `model.safetensors` if a run has
            no best yet) or "last" (`model.safetensors`).
        device: where to put the model ("cpu", "cuda", "mps").
        notify: called with a line for the user (stderr): which run was picked when `run_dir`
            is None, and a warning for each library whose installed version differs from the
            run's in a way that can change results.

    Raises:
        CheckpointError: a missing, incomplete, corrupt or mismatched run (names the file).
    """
    if run_dir is None:
        run_dir = find_latest_run()
        if notify is not None:
            notify(f"using the latest run: {run_dir}")
    run = _load_run_files(Path(run_dir), weights, device)
    if notify is not None:
        for line in versions.warnings_for(run.meta.get("versions")):
            notify(f"warning: {line}")
    return run


def _weights_path(run_dir: Path, weights: str) -> Path:
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
        raise CheckpointError(
            f"run directory '{run_dir}' does not exist: {TRAIN_HINT}, or check the path."
        )
    if not run_dir.is_dir():
        raise CheckpointError(
            f"checkpoint '{run_dir}' is a file, not a run directory: pass the folder that holds "
            f"{CONFIG_FILE}, {TOKENIZER_FILE} and {MODEL_FILE}."
        )
    if weights_path is None:
        weights_path = _weights_path(run_dir, weights)

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
        meta=read_meta(run_dir),
        weights_path=weights_path,
    )
