"""The transcoder folder: circuit-tracer's transcoder set, so circuit-tracer loads it as it is.

`llmcli sae train --kind transcoder --out DIR` writes (default DIR: `<run>/transcoders/`):

- `config.yaml`: what circuit-tracer's `load_transcoders` reads: `model_kind: transcoder_set`,
  `scan` (an identifier of the set), `feature_input_hook: mlp.hook_in` and
  `feature_output_hook: mlp.hook_out` (the MLP's input and output in its replacement model),
  `transcoders` (the layer files, in layer order, relative to the folder: circuit-tracer opens
  them relative to the working directory, so a caller makes them absolute), `activation`
  (`topk` with `k`, or `relu`; none for a BatchTopK set, which circuit-tracer then runs as the
  JumpReLU its `threshold` makes), and under `llmcli` what llmcli reads back: the layers, the
  run, the training settings and how far training got;
- `layer_{l}.safetensors`: `W_enc` `(F, C)`, `W_dec` `(F, C)`, `b_enc` `(F,)`, `b_dec` `(C,)`, and
  where they apply `W_skip` `(C, C)` and `activation_function.threshold` `(F,)`, float32;
- beside them, training's `metrics.jsonl` and resume state `state.pt`.

Every file is written atomically; a reader checks what it reads and names the file at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save

from llmcli.errors import CheckpointError, InputError
from llmcli.fileio import atomic_write_bytes, atomic_write_text
from llmcli.inspection.sae.folder import LoadedSAE, SAEInfo
from llmcli.inspection.sae.transcoder import Transcoder, TranscoderSet
from llmcli.runs.formats import read_weights
from llmcli.runs.loading import LoadedRun

CONFIG_FILE = "config.yaml"
THRESHOLD = "activation_function.threshold"
#: circuit-tracer's names of the MLP's input and output in its TransformerLens replacement model.
INPUT_HOOK, OUTPUT_HOOK = "mlp.hook_in", "mlp.hook_out"


def layer_file(layer: int) -> str:
    return f"layer_{layer}.safetensors"


@dataclass
class TranscoderInfo:
    """What llmcli knows of a saved set besides its weights (`config.yaml`'s `llmcli`).

    Attributes:
        run: the run it was trained on (as given when it was trained).
        run_step: that run's step then (the transcoders are of those weights).
        settings: the training settings (`SAEConfig.to_dict()`, `features` resolved).
        step: optimizer steps trained.
        tokens: activations (per layer) trained on.
    """

    run: str
    settings: dict[str, Any]
    run_step: int = 0
    step: int = 0
    tokens: int = 0


@dataclass
class LoadedTranscoders:
    """A transcoder set read from its folder (in eval mode, on the CPU until moved)."""

    transcoders: TranscoderSet
    info: TranscoderInfo
    folder: Path


def circuit_tracer_config(transcoders: TranscoderSet, info: TranscoderInfo) -> dict[str, Any]:
    """`config.yaml`'s content (see the module doc)."""
    first = transcoders.transcoders[0]
    cfg: dict[str, Any] = {
        "model_kind": "transcoder_set",
        "scan": f"llmcli/{Path(info.run).name}",
        "feature_input_hook": INPUT_HOOK,
        "feature_output_hook": OUTPUT_HOOK,
        "transcoders": [layer_file(layer) for layer in transcoders.layers],
    }
    if first.activation == "topk":
        cfg |= {"activation": "topk", "k": first.k}
    elif first.activation in ("relu", "tanh"):
        cfg["activation"] = "relu"
    cfg["llmcli"] = {
        "layers": transcoders.layers,
        "d_model": first.d_model,
        "d_transcoder": first.d_transcoder,
        "run": info.run,
        "run_step": info.run_step,
        "settings": info.settings,
        "step": info.step,
        "tokens": info.tokens,
    }
    return cfg


def save_transcoders(folder: Path, transcoders: TranscoderSet, info: TranscoderInfo) -> None:
    """Write each `layer_{l}.safetensors`, then `config.yaml`, into `folder` (made if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    for layer, tc in zip(transcoders.layers, transcoders.transcoders, strict=True):
        tensors = {"W_enc": tc.W_enc, "W_dec": tc.W_dec, "b_enc": tc.b_enc, "b_dec": tc.b_dec}
        if tc.W_skip is not None:
            tensors["W_skip"] = tc.W_skip
        if tc.activation == "batchtopk":
            tensors[THRESHOLD] = tc.threshold
        tensors = {k: t.detach().to("cpu", torch.float32).contiguous() for k, t in tensors.items()}
        atomic_write_bytes(folder / layer_file(layer), save(tensors))
    text = yaml.safe_dump(circuit_tracer_config(transcoders, info), sort_keys=False)
    atomic_write_text(folder / CONFIG_FILE, text)


def is_transcoder_folder(folder: str | Path) -> bool:
    return (Path(folder) / CONFIG_FILE).is_file()


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(
            f"'{path.parent}' holds no {CONFIG_FILE}: it is not a transcoder folder; train one "
            "with `llmcli sae train --kind transcoder --layers all`."
        )
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CheckpointError(f"transcoder config '{path}' cannot be read ({exc}).") from None
    meta = cfg.get("llmcli") if isinstance(cfg, dict) else None
    if not isinstance(meta, dict) or cfg.get("model_kind") != "transcoder_set":
        raise CheckpointError(
            f"transcoder config '{path}' is not an llmcli transcoder set (model_kind "
            "transcoder_set with an llmcli section): `llmcli sae train --kind transcoder` "
            "writes one."
        )
    return cfg


def load_transcoders(folder: str | Path) -> LoadedTranscoders:
    """Read a folder that `save_transcoders` wrote.

    Raises:
        CheckpointError: a missing or unreadable `config.yaml` or layer file, or weights that do
            not fit the config (the file named).
    """
    folder = Path(folder)
    cfg = _read_config(folder / CONFIG_FILE)
    meta = cfg["llmcli"]
    try:
        settings = dict(meta.get("settings") or {})
        layers = [int(layer) for layer in meta["layers"]]
        d_model, d_transcoder = int(meta["d_model"]), int(meta["d_transcoder"])
        k = int(settings.get("k") or 1)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"transcoder config '{folder / CONFIG_FILE}' lacks or misreads {exc}: write it "
            "again with `llmcli sae train --kind transcoder`."
        ) from None
    if not layers:
        raise CheckpointError(
            f"transcoder config '{folder / CONFIG_FILE}' lists no layer: a transcoder set "
            "has one a layer (`llmcli sae train --kind transcoder --layers all`)."
        )
    activation = str(settings.get("activation", "topk"))
    skip = bool(settings.get("skip", False))
    built = []
    for layer in layers:
        tc = Transcoder(d_model, d_transcoder, k, activation, skip)
        path = folder / layer_file(layer)
        tensors, _ = read_weights(path)
        tensors["threshold"] = tensors.pop(THRESHOLD, torch.zeros(d_transcoder))
        expected = {name: tuple(t.shape) for name, t in tc.state_dict().items()}
        got = {name: tuple(t.shape) for name, t in tensors.items()}
        if got != expected:
            raise CheckpointError(
                f"transcoder weights '{path}' hold {got}, where config.yaml needs {expected}."
            )
        tc.load_state_dict(tensors)
        built.append(tc)
    info = TranscoderInfo(
        run=str(meta.get("run", "")),
        settings=settings,
        run_step=int(meta.get("run_step", 0)),
        step=int(meta.get("step", 0)),
        tokens=int(meta.get("tokens", 0)),
    )
    return LoadedTranscoders(TranscoderSet(layers, built).eval(), info, folder)


def layer_as_sae(loaded: LoadedTranscoders, layer: int | None) -> LoadedSAE:
    """One layer's transcoder as the readers of an SAE take it (`sae features`): its features
    read `blocks.{layer}.mlp_in`, and their directions (`W_dec`) write into the residual stream,
    which is what a feature's logit effect goes through.

    Raises:
        InputError: no layer given, or one the set does not hold.
    """
    layers = loaded.transcoders.layers
    if layer not in layers:
        given = "no --layer" if layer is None else f"--layer {layer}"
        raise InputError(
            f"{given}: give the layer whose transcoder features to read; '{loaded.folder}' holds "
            f"layers {', '.join(map(str, layers))}."
        )
    info = SAEInfo(
        hook=f"blocks.{layer}.mlp_in",
        run=loaded.info.run,
        settings=loaded.info.settings,
        step=loaded.info.step,
        tokens=loaded.info.tokens,
    )
    return LoadedSAE(loaded.transcoders[layer], info, loaded.folder)  # type: ignore[arg-type]


def check_fits(loaded: LoadedTranscoders, run: LoadedRun, fix: str) -> str | None:
    """Whether the set `loaded` reads `run`'s model: an `InputError` ending with `fix` when it
    cannot (another width, a layer the run lacks); what differs when it was trained on another
    run or at another step of this one (None: on these weights), for the caller to refuse or
    to say."""
    tcs, info = loaded.transcoders, loaded.info
    width = tcs.transcoders[0].d_model
    if width != run.model.n_embed or max(tcs.layers) >= run.model.n_layer:
        raise InputError(
            f"the transcoders in '{loaded.folder}' (width {width}, layers {tcs.layers}) do not "
            f"fit run '{run.run_dir}' (width {run.model.n_embed}, {run.model.n_layer} layers): "
            f"they belong to another run; {fix}"
        )
    inside = run.run_dir.resolve() in Path(loaded.folder).resolve().parents
    if (inside or Path(info.run).resolve() == run.run_dir.resolve()) and info.run_step == run.step:
        return None
    return (
        f"the transcoders in '{loaded.folder}' were trained on run '{info.run}' at step "
        f"{info.run_step}, not on '{run.run_dir}' at step {run.step}"
    )
