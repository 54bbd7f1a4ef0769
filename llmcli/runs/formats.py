"""The formats of a run's files: safetensors weights, the resume state, `meta.json`.

Weights are safetensors and the resume state is read with `torch.load(weights_only=True)`:
loading a run never runs code from it. Each reader checks what it reads and raises a
`CheckpointError` that names the file and what is wrong with it. The functions here take file
paths; which file of a run directory holds what is `llmcli.runs.directory`'s business.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pickle
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import safe_open
from safetensors.torch import save

from llmcli.errors import CheckpointError
from llmcli.fileio import JSONFileError, atomic_write_bytes, read_json

logger = logging.getLogger(__name__)

WEIGHTS_FORMAT = "llmcli-1"


# ---------------------------------------------------------------------------------------------
# Weights (safetensors)
# ---------------------------------------------------------------------------------------------


def unique_state_dict(model: Any) -> dict[str, Any]:
    """The model's state dict (or `model` itself, a state dict) with tied tensors (same
    storage) kept once, contiguous, on CPU.

    safetensors refuses tensors that share memory (tied embedding / LM head); the first name
    keeps the tensor and `load_weights` restores the alias through the model itself.
    """
    out: dict[str, Any] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    tensors = model if isinstance(model, dict) else model.state_dict()
    for name, tensor in tensors.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() > 0 and key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def weights_bytes(model: Any, metadata: dict[str, Any]) -> bytes:
    """Serialize `model`'s weights (or a state dict) to safetensors bytes with string
    `metadata`."""
    meta = {"format": WEIGHTS_FORMAT, **{k: str(v) for k, v in metadata.items()}}
    return save(unique_state_dict(model), metadata=meta)


def read_weights(path: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Read a safetensors file into CPU tensors and its metadata, refusing anything else.

    The tensors are memory-mapped from the file (copy on write), not read into a buffer first,
    so a model's weights are in memory once. They and the metadata come from the one file
    opened: a run saved meanwhile (an atomic rename over the path) leaves the mapping as it was.

    Raises:
        CheckpointError: missing, not safetensors (a pickle, say), truncated or corrupt.
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            _check_safetensors_header(path, f)
        with safe_open(path, framework="pt") as st:
            tensors = {name: st.get_tensor(name) for name in st.keys()}
            metadata = st.metadata() or {}
    except FileNotFoundError:
        raise CheckpointError(f"weights file '{path}' is missing.") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read weights file '{path}': {exc.strerror}.") from None
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error types for bad data
        raise CheckpointError(
            f"weights file '{path}' is corrupt or truncated ({exc}); retrain, or use the "
            "other weights file of the run (--weights last / best)."
        ) from None
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def _check_safetensors_header(path: Path, f: BinaryIO) -> None:
    # A safetensors file starts with an 8-byte little-endian header length and a JSON header.
    # Checking it first turns pickles and other foreign files into a clear message; only the
    # header is read, the tensors are safetensors' to map.
    not_st = (
        f"weights file '{path}' is not a safetensors file (a pickle or other format?); "
        "llmcli only loads safetensors weights, which cannot run code."
    )
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise CheckpointError(f"weights file '{path}' is truncated ({size} bytes).")
    (n,) = struct.unpack("<Q", f.read(8))
    if n < 2 or n > 100_000_000 or f.read(1) != b"{":
        raise CheckpointError(not_st)
    if 8 + n > size:
        raise CheckpointError(
            f"weights file '{path}' is truncated: its header says {n} bytes but the file has "
            f"{size} in all."
        )
    try:
        header = json.loads(b"{" + f.read(n - 1))
    except ValueError:
        raise CheckpointError(not_st) from None
    if not isinstance(header, dict):
        raise CheckpointError(not_st)
    # Only well-formed offsets are compared with the size here; safetensors refuses the rest.
    offsets = [v.get("data_offsets") for k, v in header.items() if isinstance(v, dict)]
    ends = [
        o[1]
        for o in offsets
        if isinstance(o, list) and len(o) == 2 and all(type(x) is int and x >= 0 for x in o)
    ]
    if ends and 8 + n + max(ends) > size:
        raise CheckpointError(
            f"weights file '{path}' is truncated: {size} bytes, {8 + n + max(ends)} expected."
        )


def load_weights(model: Any, tensors: dict[str, Any], path: str | Path) -> None:
    """Load `tensors` into `model`, checking names and shapes; tied aliases may be absent.

    Raises:
        CheckpointError: a tensor is missing, unexpected or of the wrong shape (names it).
    """
    check_weights(model, tensors, path)
    with torch.no_grad():
        model.load_state_dict(tensors, strict=False)


def check_weights(
    model: Any, tensors: dict[str, Any], path: str | Path, what: str = "weights file"
) -> None:
    """Check that `tensors` fit `model` exactly, without loading them: every name, and each a
    floating-point tensor of the model's shape; a tied alias (sharing storage with a tensor
    that is present) may be absent.

    Raises:
        CheckpointError: naming `what` and `path` and the tensors that do not fit.
    """
    path = Path(path)
    expected = model.state_dict()
    unexpected = sorted(map(str, set(tensors) - set(expected)))
    if unexpected:
        raise CheckpointError(
            f"{what} '{path}' has tensors the model does not: {', '.join(unexpected[:5])}"
            f"{' ...' if len(unexpected) > 5 else ''}; the weights do not match config.yaml."
        )
    for name, tensor in tensors.items():
        if not (isinstance(tensor, torch.Tensor) and tensor.is_floating_point()):
            raise CheckpointError(
                f"{what} '{path}': '{name}' is a {type(tensor).__name__}"
                f"{f' of {tensor.dtype}' if isinstance(tensor, torch.Tensor) else ''}, not a "
                "floating-point tensor."
            )
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{what} '{path}': tensor '{name}' has shape {tuple(tensor.shape)} but "
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
            f"{what} '{path}' lacks tensors {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; it is incomplete or from another model."
        )


# ---------------------------------------------------------------------------------------------
# Resume state (torch.load with weights_only=True)
# ---------------------------------------------------------------------------------------------


def save_state(path: str | Path, state: dict[str, Any]) -> None:
    """Atomically write a resume state with `torch.save`, tagged with this format for
    `load_state` (plain tensors, numbers, strings and containers only, so that it can be read
    with `weights_only=True`)."""
    buffer = io.BytesIO()
    torch.save({"format": WEIGHTS_FORMAT, **state}, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def load_state(path: str | Path) -> dict[str, Any]:
    """Read a resume state safely (`weights_only=True`: no code runs).

    Raises:
        CheckpointError: missing, unsafe (arbitrary pickled objects), truncated or corrupt.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no resume state '{path}'.")
    state = torch_load_safely(
        path,
        "resume state",
        unsafe="It was not written by llmcli: remove it to start afresh.",
        corrupt="Remove it to start afresh, or restore it from a backup.",
    )
    if not isinstance(state, dict) or state.get("format") != WEIGHTS_FORMAT:
        raise CheckpointError(
            f"resume state '{path}' is not an llmcli resume state (format "
            f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r})."
        )
    return state


def torch_load_safely(path: Path, what: str, *, unsafe: str, corrupt: str) -> Any:
    """`torch.load(path, weights_only=True)` on the CPU: no code from the file runs.

    Args:
        path: the file.
        what: how messages name it ("resume state").
        unsafe: what to do about a file that holds pickled Python objects (refused unread).
        corrupt: what to do about a truncated or corrupt file.

    Raises:
        CheckpointError: the file holds objects other than tensors and plain data (torch's
            weights-only unpickler refuses a pickled global unread), or cannot be read.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch words it "Unsupported global" (before 2.6) or "unsupported GLOBAL" (since):
        # either way no object was built.
        if "global" in str(exc).lower():
            raise CheckpointError(
                f"{what} '{path}' holds Python objects other than tensors and plain data; it "
                f"was refused unread (loading it could run code). {unsafe}"
            ) from None
        reason = _first_line(exc)
    except Exception as exc:  # a damaged file fails in many ways (zip, pickle, EOF, storage)
        reason = _first_line(exc)
    size = path.stat().st_size
    raise CheckpointError(
        f"{what} '{path}' is corrupt or truncated ({size} bytes; {reason}). {corrupt}"
    ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# What each field of `meta.json` that llmcli reads must be: anything else is left out.
_META_FIELDS: dict[str, Callable[[Any], bool]] = {
    "step": _count,
    "tokens": _count,
    "max_steps": _count,
    "vocab_size": _count,
    "n_params": _count,
    "world_size": _count,
    "elapsed_s": lambda v: _number(v) and v >= 0,
    "flops_per_token": _count,
    "peak_flops": lambda v: _number(v) and v >= 0,
    "best_val_loss": _number,
    "best_step": _count,
    "device": lambda v: isinstance(v, str),
    "dtype": lambda v: isinstance(v, str),
    "last_eval": lambda v: isinstance(v, dict) and all(map(_number, v.values())),
    "versions": lambda v: (
        isinstance(v, dict) and all(isinstance(x, (str, type(None))) for x in v.values())
    ),
    # How the tokenizer was made (`llmcli.data.prepared.TokenData.tokenizer_training`).
    "tokenizer_training": lambda v: isinstance(v, dict) and isinstance(v.get("kind"), str),
    # A LoRA run's parameter counts (`llmcli.training.lora.parameter_counts`).
    "lora": lambda v: isinstance(v, dict) and all(map(_count, v.values())),
}


def read_meta(path: str | Path) -> dict[str, Any]:
    """A run's `meta.json` as a dict whose fields have the types llmcli reads them as.

    It is informative only, so nothing here is an error: an absent file gives {}, a damaged one
    (not JSON, not an object) gives {} with a warning naming the file and what is wrong, and a
    field of the wrong type (`"tokens": "many"`) is left out with a warning, so that what is
    right can still be shown. A null field is kept: it means "none yet" (`best_val_loss` before
    the first evaluation).
    """
    path = Path(path)
    try:
        meta = read_json(path)
    except JSONFileError as exc:
        if not exc.missing:
            _warn_damaged(path, str(exc))
        return {}
    if not isinstance(meta, dict):
        _warn_damaged(path, f"it holds a JSON {type(meta).__name__}, not an object")
        return {}
    bad = [k for k, ok in _META_FIELDS.items() if meta.get(k) is not None and not ok(meta[k])]
    if bad:
        logger.warning(
            "%s: left out %s (not of the type llmcli writes)",
            path,
            ", ".join(f"{k} ({_shown(meta[k])})" for k in bad),
        )
    return {k: v for k, v in meta.items() if k not in bad}


def _warn_damaged(path: Path, problem: str) -> None:
    # Readers show the run without it, so say why its facts are missing: without this, the
    # only trace is "this run records no software versions", which points elsewhere.
    logger.warning(
        "%s is damaged: %s; the step, tokens, timings and versions it records are not shown "
        "(the run's other files are read as usual).",
        path,
        problem,
    )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
