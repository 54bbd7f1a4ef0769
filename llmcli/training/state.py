"""What a training run carries across a save: its counters and every random number generator.

Exact resume. A save records the model, the optimizer, the `TrainState` counters (the schedule is
a function of the step), the torch / CUDA / NumPy / Python RNG states of every rank and the
batch sampler's position. Evaluation draws from its own samplers, re-seeded at every evaluation,
so it never moves the training stream. A run resumed from a save therefore replays the same
batches with the same random numbers and, on CPU, ends with bitwise-identical weights.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmcli.config import Config
from llmcli.errors import CheckpointError
from llmcli.runs.directory import CONFIG_FILE, STATE_FILE


@dataclass
class TrainState:
    """The training loop's counters: saved with every checkpoint, restored by `--resume`.

    Attributes:
        step: optimizer steps done.
        tokens: training tokens seen, over every rank.
        elapsed_base: training seconds of the sessions before this one.
        best_val_loss: the lowest validation loss so far (inf before the first evaluation).
        best_step: the step of `best_val_loss`.
        last_eval: the latest evaluation's mean loss per split ("train", "val").
        last_saved: the step of the latest save in this run (-1: none yet); not saved.
        session_start: `time.perf_counter()` when this session started; not saved.
    """

    step: int = 0
    tokens: int = 0
    elapsed_base: float = 0.0
    best_val_loss: float = math.inf
    best_step: int | None = None
    last_eval: dict[str, float] = field(default_factory=dict)
    last_saved: int = -1
    session_start: float = field(default_factory=time.perf_counter)

    @property
    def elapsed(self) -> float:
        """Training seconds so far, earlier sessions included."""
        return self.elapsed_base + time.perf_counter() - self.session_start

    def record_eval(self, losses: dict[str, float]) -> bool:
        """Keep an evaluation's losses; True when its val loss is the best so far."""
        self.last_eval = losses
        best = losses["val"] < self.best_val_loss
        if best:
            self.best_val_loss, self.best_step = losses["val"], self.step
        return best

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "elapsed_s": self.elapsed,
            "best_val_loss": self.best_val_loss,
            "best_step": self.best_step,
            "last_eval": self.last_eval,
        }

    @classmethod
    def from_state_dict(cls, saved: dict[str, Any], session_start: float) -> TrainState:
        """The counters of a saved resume state (its step counts as the latest save)."""
        return cls(
            step=int(saved["step"]),
            tokens=int(saved["tokens"]),
            elapsed_base=float(saved["elapsed_s"]),
            best_val_loss=float(saved.get("best_val_loss", math.inf)),
            best_step=saved.get("best_step"),
            last_eval=dict(saved.get("last_eval", {})),
            last_saved=int(saved["step"]),
            session_start=session_start,
        )


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
