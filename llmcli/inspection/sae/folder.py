"""The SAE folder: SAELens's format, so that SAELens loads an llmcli SAE as it is.

`llmcli sae train --out DIR` writes (default DIR: `<run>/sae/<hook point>/`):

- `cfg.json`: SAELens's config (format 6): `architecture` (`topk`, or `jumprelu` for a
  BatchTopK SAE, which runs as a JumpReLU with the threshold it learned), `d_in`, `d_sae`, `k`,
  `dtype`, `apply_b_dec_to_input: true` (the encoder subtracts `b_dec`), no normalisation,
  `reshape_activations: hook_z` for `attn.z`, and `metadata`: `hook_name` in TransformerLens's
  spelling for the Hugging Face export (`blocks.1.hook_resid_post`), `context_size`, and under
  `llmcli` what llmcli reads back: the hook point in its own spelling, the run, the training
  settings and how far training got;
- `sae_weights.safetensors`: `W_enc` `(d_in, F)`, `W_dec` `(F, d_in)`, `b_enc` `(F,)`, `b_dec`
  `(d_in,)` (and `threshold` `(F,)` for jumprelu), float32;
- beside them, training's own files: `metrics.jsonl` and the resume state `state.pt`
  (`llmcli.inspection.sae.state`).

Every file is written atomically; a reader checks what it reads and names the file at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from llmcli.errors import CheckpointError
from llmcli.fileio import JSONFileError, atomic_write_bytes, atomic_write_json, read_json
from llmcli.inspection.sae.model import SparseAutoencoder
from llmcli.inspection.sae.points import is_heads, transformer_lens_name
from llmcli.runs.formats import read_weights

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
METRICS_FILE = "metrics.jsonl"
STATE_FILE = "state.pt"
#: The SAELens config format written: SAELens reads a config of a version below 6 as its old
#: format (renaming keys), so `metadata.sae_lens_version` says 6.0.0, the format's first release.
SAELENS_FORMAT = "6.0.0"
_ARCHITECTURES = {"topk": "topk", "batchtopk": "jumprelu"}


@dataclass
class SAEInfo:
    """What llmcli knows of a saved SAE besides its weights (`cfg.json`'s `metadata.llmcli`).

    Attributes:
        hook: the hook point, in llmcli's spelling.
        run: the run it was trained on (as given when it was trained).
        settings: the training settings (`SAEConfig.to_dict()`, `features` resolved).
        step: optimizer steps trained.
        tokens: activations trained on.
    """

    hook: str
    run: str
    settings: dict[str, Any]
    step: int = 0
    tokens: int = 0


@dataclass
class LoadedSAE:
    """An SAE read from its folder (in eval mode, on the CPU until moved)."""

    sae: SparseAutoencoder
    info: SAEInfo
    folder: Path


def saelens_config(sae: SparseAutoencoder, info: SAEInfo, context_size: int) -> dict[str, Any]:
    """`cfg.json`'s content for `sae` (see the module doc)."""
    cfg: dict[str, Any] = {
        "architecture": _ARCHITECTURES[sae.activation],
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "reshape_activations": "hook_z" if is_heads(info.hook) else "none",
    }
    if sae.activation == "topk":
        cfg |= {"k": sae.k, "rescale_acts_by_decoder_norm": False}
    cfg["metadata"] = {
        "sae_lens_version": SAELENS_FORMAT,
        "sae_lens_training_version": None,
        "model_name": Path(info.run).name,
        "hook_name": transformer_lens_name(info.hook),
        "hook_head_index": None,
        "context_size": context_size,
        "prepend_bos": False,
        "llmcli": {
            "hook": info.hook,
            "run": info.run,
            "settings": info.settings,
            "step": info.step,
            "tokens": info.tokens,
        },
    }
    return cfg


def save_sae(folder: Path, sae: SparseAutoencoder, info: SAEInfo, context_size: int) -> None:
    """Write `sae_weights.safetensors`, then `cfg.json`, into `folder` (made if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        "W_enc": sae.W_enc,
        "W_dec": sae.W_dec,
        "b_enc": sae.b_enc,
        "b_dec": sae.b_dec,
    }
    if sae.activation == "batchtopk":
        tensors["threshold"] = sae.threshold
    tensors = {
        name: t.detach().to("cpu", torch.float32).contiguous() for name, t in tensors.items()
    }
    atomic_write_bytes(folder / WEIGHTS_FILE, save(tensors))
    atomic_write_json(folder / CFG_FILE, saelens_config(sae, info, context_size))


def _read_cfg(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(
            f"'{path.parent}' holds no {CFG_FILE}: it is not an SAE folder (`llmcli sae train` "
            "writes one; pass its folder)."
        )
    try:
        cfg = read_json(path)
    except JSONFileError as exc:
        raise CheckpointError(
            f"SAE config '{path}' cannot be read as JSON ({exc.cause})."
        ) from None
    llmcli = cfg.get("metadata", {}).get("llmcli") if isinstance(cfg, dict) else None
    if not isinstance(llmcli, dict) or not isinstance(llmcli.get("hook"), str):
        raise CheckpointError(
            f"SAE config '{path}' has no metadata.llmcli.hook: llmcli reads the SAEs it trained "
            "(`llmcli sae train`)."
        )
    return cfg


def load_sae(folder: str | Path) -> LoadedSAE:
    """Read an SAE folder that `save_sae` wrote.

    Raises:
        CheckpointError: a missing or unreadable `cfg.json` or weights file, an architecture
            llmcli does not train, or weights that do not fit the config (the file named).
    """
    folder = Path(folder)
    cfg = _read_cfg(folder / CFG_FILE)
    activation = {v: k for k, v in _ARCHITECTURES.items()}.get(cfg.get("architecture"))
    if activation is None:
        raise CheckpointError(
            f"SAE config '{folder / CFG_FILE}': architecture {cfg.get('architecture')!r} is not "
            f"one llmcli trains ({', '.join(_ARCHITECTURES.values())})."
        )
    meta = cfg["metadata"]["llmcli"]
    try:
        d_in, d_sae = int(cfg["d_in"]), int(cfg["d_sae"])
        k = int(cfg.get("k") or meta.get("settings", {}).get("k") or 1)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"SAE config '{folder / CFG_FILE}' lacks {exc}.") from None
    sae = SparseAutoencoder(d_in, d_sae, k, activation)
    tensors, _ = read_weights(folder / WEIGHTS_FILE)
    expected = {name: tuple(t.shape) for name, t in sae.state_dict().items()}
    if activation == "topk":
        expected.pop("threshold")
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != expected:
        raise CheckpointError(
            f"SAE weights '{folder / WEIGHTS_FILE}' hold {got}, where cfg.json needs {expected}."
        )
    sae.load_state_dict(tensors, strict=False)
    info = SAEInfo(
        hook=meta["hook"],
        run=str(meta.get("run", "")),
        settings=dict(meta.get("settings") or {}),
        step=int(meta.get("step", 0)),
        tokens=int(meta.get("tokens", 0)),
    )
    return LoadedSAE(sae.eval(), info, folder)
