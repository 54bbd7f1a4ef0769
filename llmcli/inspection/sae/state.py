"""What an SAE training carries across a save: `SAEState`, written to `state.pt` last.

`state.pt` holds everything a resumed training needs to go on exactly: the SAE's parameters
(the weights file beside it holds the same, for SAELens), Adam's moments, the window sampler's
position (its own generator: nothing else draws from it), each feature's tokens since it last
fired (what "dead" is counted from), the counters, and the size of `metrics.jsonl` at the save
(a resumed training cuts it back there and writes the rest again). The SAE's initial weights
come from a generator of their own, seeded by `--seed`, so no global random state is involved,
and a resumed training ends, on the CPU, with the same weights bit for bit as one never stopped.

It is written with `llmcli.runs.formats.save_state` (atomic) and read with `load_state`
(`torch.load(weights_only=True)`: no code runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmcli.errors import CheckpointError
from llmcli.runs.formats import load_state, save_state

# The keys every state holds, with their types: checked before any of it is used.
_KEYS: dict[str, type | tuple[type, ...]] = {
    "sae": dict,
    "optimizer": dict,
    "sampler": dict,
    "since_fired": torch.Tensor,
    "settings": dict,
    "run": str,
    "run_step": int,
    "step": int,
    "tokens": int,
    "elapsed_s": (int, float),
    "metrics_bytes": int,
}


@dataclass
class SAEState:
    """An SAE training's resume state (see the module doc).

    Attributes:
        sae: the SAE's state dict.
        optimizer: Adam's state dict.
        sampler: the window sampler's (`BatchSampler.state_dict`).
        since_fired: `(F,)` long: tokens since each feature last fired.
        settings: the training settings (`SAEConfig.to_dict()`, `features` resolved).
        run: the run trained on; run_step: its step then (its weights must not have moved).
        step, tokens, elapsed_s: optimizer steps, activations and seconds so far.
        metrics_bytes: the size of `metrics.jsonl` at the save.
    """

    sae: dict[str, Any]
    optimizer: dict[str, Any]
    sampler: dict[str, Any]
    since_fired: torch.Tensor
    settings: dict[str, Any]
    run: str
    run_step: int
    step: int
    tokens: int
    elapsed_s: float
    metrics_bytes: int

    def save(self, path: Path) -> None:
        save_state(path, {key: getattr(self, key) for key in _KEYS})

    @classmethod
    def load(cls, path: Path) -> SAEState:
        """Read `state.pt`, checking that every key is there with its type.

        Raises:
            CheckpointError: a missing, unsafe or damaged file, or a key missing or mistyped.
        """
        state = load_state(path)
        bad = [key for key, kind in _KEYS.items() if not isinstance(state.get(key), kind)]
        if bad:
            raise CheckpointError(
                f"SAE resume state '{path}' lacks or mistypes {', '.join(bad)}: remove it (and "
                "train afresh with --overwrite)."
            )
        return cls(**{key: state[key] for key in _KEYS})
