"""Every random number generator a training process draws from: seeding them, saving their
states as plain data and tensors (loadable with `weights_only=True`), restoring them, and
checking that a saved state has the form restoring it reads.

A save records every rank's states (`llmcli.training.state.ResumeState.rng`); a resume puts its
rank's back, so that dropout and the batches draw the same numbers as an uninterrupted run.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

# The sizes of a CPU generator's state and of the Mersenne Twister's (NumPy's key and Python's
# internal state, whose last entry is the position in the key).
_TORCH_STATE_BYTES = torch.Generator().get_state().numel()
_MT_WORDS = 624


def rng_state_ok(state: dict[str, Any]) -> bool:
    """Whether `state` is what `rng_state` returns, each part of the form `set_rng_state`
    reads: torch's state (and CUDA's, if any) as bytes, NumPy's 5 parts (the MT19937 key of
    624 words), Python's 3 (625 words, the last the position)."""
    numpy_state, python_state = state.get("numpy"), state.get("python")
    if not (
        generator_state_ok(state.get("torch"))
        and isinstance(state.get("cuda", torch.zeros(0, dtype=torch.uint8)), torch.Tensor)
        and isinstance(numpy_state, (tuple, list))
        and len(numpy_state) == 5
        and isinstance(python_state, (tuple, list))
        and len(python_state) == 3
    ):
        return False
    name, keys, pos, has_gauss, cached = numpy_state
    version, internal, gauss = python_state
    return (
        name == "MT19937"
        and isinstance(keys, torch.Tensor)
        and keys.shape == (_MT_WORDS,)
        and not keys.is_floating_point()
        and type(pos) is int
        and 0 <= pos <= _MT_WORDS
        and type(has_gauss) is int
        and isinstance(cached, (int, float))
        and type(version) is int
        and isinstance(internal, (tuple, list))
        and len(internal) == _MT_WORDS + 1
        and all(type(w) is int and 0 <= w < 2**32 for w in internal)
        and internal[-1] <= _MT_WORDS
        and (gauss is None or isinstance(gauss, float))
    )


def generator_state_ok(value: Any) -> bool:
    """A torch generator's state: the bytes `torch.Generator.get_state` returns."""
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.uint8
        and value.shape == (_TORCH_STATE_BYTES,)
    )


def seed_everything(seed: int) -> None:
    """Seed torch's, Python's and NumPy's global generators (dropout and friends use them)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every RNG state this process uses, as tensors and plain data (weights_only-loadable)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (
            name,
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if device.type == "mps":  # dropout on MPS draws from its own generator
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    if device.type == "mps" and "mps" in state:
        torch.mps.set_rng_state(state["mps"])
