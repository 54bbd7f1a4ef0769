"""`train.init_from`: start a run from a Hugging Face folder (or an `llmcli export`).

(`llmcli.training.init_from` tells such a folder from an llmcli run directory, and grows the
vocabulary for chat tokens.)

The folder's `config.json` names its architecture (GPT-2, GPT-NeoX or Arcee, see
`llmcli.hf.architectures`); the model's shape comes from the folder's `config.json`, the tokenizer
from its `tokenizer.json`, and the weights from its `model.safetensors` (or sharded safetensors, or
`pytorch_model.bin` read with `weights_only=True`: loading never runs code from the folder).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from llmcli.config import Config, DataConfig, ModelConfig
from llmcli.config.shipped import shipped_configs
from llmcli.data.tokenizer import Tokenizer, load_tokenizer
from llmcli.errors import CheckpointError, InputError
from llmcli.hf.architectures import for_model_type
from llmcli.hf.common import (
    HF_CONFIG_FILE,
    HF_TOKENIZER_FILE,
    HF_TORCH_WEIGHTS,
    HF_WEIGHTS_FILE,
    HF_WEIGHTS_INDEX,
    positive_int,
)
from llmcli.hub import resolve_pretrained, split_hub_name
from llmcli.model.gpt import Transformer
from llmcli.runs.formats import load_weights, torch_load_safely

logger = logging.getLogger(__name__)

# What a model repo on the Hub needs to hold for init_from: the rest (other formats) is skipped.
HUB_FILES = [
    HF_CONFIG_FILE,
    HF_WEIGHTS_FILE,
    HF_WEIGHTS_INDEX,
    "model-*.safetensors",
    HF_TORCH_WEIGHTS,
    HF_TOKENIZER_FILE,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
]

# ---------------------------------------------------------------------------------------------
# Import (train.init_from)
# ---------------------------------------------------------------------------------------------


def _weights_files(folder: Path) -> list[Path]:
    """The weight files of an HF folder, in the order `transformers` prefers them ([] if none)."""
    if (folder / HF_WEIGHTS_FILE).is_file():
        return [folder / HF_WEIGHTS_FILE]
    index = folder / HF_WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (ValueError, OSError, AttributeError):
            weight_map = None
        if not isinstance(weight_map, dict) or not all(
            isinstance(s, str) for s in weight_map.values()
        ):
            raise CheckpointError(
                f"'{index}' is not a safetensors index: it needs weight_map, a mapping of "
                "tensor names to shard file names."
            )
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(
                f"'{index}' names shards that are missing: {', '.join(missing[:5])}."
            )
        return [folder / s for s in shards]
    if (folder / HF_TORCH_WEIGHTS).is_file():
        return [folder / HF_TORCH_WEIGHTS]
    return []


def _missing_base_hint(folder: Path) -> str:
    """What to do about a `train.init_from` folder that does not exist: where it was looked
    for, and the command that makes it when it is a shipped config's run
    (`checkpoints/chat`: `llmcli train chat`)."""
    looked = f"no folder '{folder.absolute()}'"
    if folder.parent == Path("checkpoints") and folder.name in shipped_configs():
        return (
            f"{looked}. It is the run that `llmcli train {folder.name}` makes: train it "
            "first, in this folder (or point train.init_from at that run, e.g. --set "
            "train.init_from=DIR)."
        )
    return (
        f"{looked}. Train that run first, or give an llmcli run directory (config.yaml, "
        "tokenizer.json, model.safetensors) or a Hugging Face model folder (config.json, "
        "model.safetensors, tokenizer.json)."
    )


def check_hf_folder(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """Check that `path` is a Hugging Face model folder and read its `config.json`.

    `path` may also be a Hub name (`gpt2`, `org/name@revision`), found in the Hugging Face
    cache or downloaded into it (see `llmcli.hub.resolve_pretrained`).

    Returns:
        `(folder, config.json as a dict)`.

    Raises:
        InputError: the folder is missing, or lacks config.json, weights or tokenizer.json (all
            that is missing is named), or config.json is not JSON.
    """
    folder = Path(path).expanduser()
    what = f"train.init_from ('{path}')"
    if not folder.exists() and split_hub_name(str(path)) is not None:
        folder = resolve_pretrained(path, what="train.init_from", patterns=HUB_FILES)
    if not folder.exists():
        raise InputError(f"{what} does not exist: {_missing_base_hint(folder)}")
    if not folder.is_dir():
        raise InputError(
            f"{what} is a file: give the folder that holds config.json, "
            "model.safetensors and tokenizer.json."
        )
    missing = []
    if not (folder / HF_CONFIG_FILE).is_file():
        missing.append(f"{HF_CONFIG_FILE} (the architecture)")
    if not _weights_files(folder):
        missing.append(f"weights ({HF_WEIGHTS_FILE}, {HF_WEIGHTS_INDEX} or {HF_TORCH_WEIGHTS})")
    if not (folder / HF_TOKENIZER_FILE).is_file():
        hint = (
            " (only vocab.json/merges.txt: re-save it with a recent transformers, "
            "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"
            if (folder / "vocab.json").is_file()
            else ""
        )
        missing.append(f"{HF_TOKENIZER_FILE}{hint}")
    if missing:
        raise InputError(
            f"{what} is not a Hugging Face model folder: it lacks " + "; ".join(missing) + " "
            "(nor an llmcli run directory: it has no config.yaml)."
        )
    cfg_path = folder / HF_CONFIG_FILE
    try:
        hf_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise InputError(f"'{cfg_path}' is not readable JSON ({exc}).") from None
    if not isinstance(hf_cfg, dict):
        raise InputError(f"'{cfg_path}' is not a model config (a JSON {type(hf_cfg).__name__}).")
    return folder, hf_cfg


def _load_folder_tokenizer(folder: Path, hf_cfg: dict[str, Any]) -> Tokenizer:
    tokenizer = load_tokenizer(folder / HF_TOKENIZER_FILE)
    source = str(folder / HF_CONFIG_FILE)
    vocab, model_vocab = tokenizer.vocab_size, positive_int(hf_cfg, source, "vocab_size")
    if model_vocab != vocab:
        relation = "larger" if model_vocab > vocab else "smaller"
        raise InputError(
            f"'{folder / HF_CONFIG_FILE}' has vocab_size {model_vocab!r}, {relation} than its "
            f"tokenizer's {vocab} tokens ('{folder / HF_TOKENIZER_FILE}'); llmcli needs them "
            "equal. Use the tokenizer the model was trained with."
        )
    return tokenizer


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight file(s), on the CPU, under their HF names.

    Raises:
        CheckpointError: no weights, or a file that is corrupt or unsafe to load.
    """
    files = _weights_files(folder)
    if not files:
        raise CheckpointError(f"'{folder}' has no weights ({HF_WEIGHTS_FILE}).")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        if path.suffix != ".safetensors":
            loaded = torch_load_safely(
                path,
                "weights file",
                unsafe="Convert it to model.safetensors.",
                corrupt="Download it again, or convert it to model.safetensors.",
            )
            if not isinstance(loaded, dict):
                raise CheckpointError(
                    f"weights file '{path}' holds a {type(loaded).__name__}, not a mapping of "
                    "tensor names to tensors."
                )
            tensors.update(loaded)
            continue
        try:
            tensors.update(load_file(path, device="cpu"))
        except Exception as exc:  # safetensors raises its own error types on bad files
            raise CheckpointError(f"'{path}' is corrupt or not a weights file ({exc}).") from None
    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(
            f"the weights of '{folder}' hold non-tensor entries: {', '.join(map(str, bad[:5]))}."
        )
    return tensors


def hf_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], Path]:
    """A Hugging Face folder's weights under llmcli's names, and the folder.

    Raises:
        InputError: the folder's architecture cannot be held.
        CheckpointError: bad weights, or a tensor the architecture does not expect (named).
    """
    folder, hf_cfg = check_hf_folder(path)
    source = f"the weights of '{folder}'"
    arch = for_model_type(hf_cfg.get("model_type"), str(folder / HF_CONFIG_FILE))
    model_cfg = model_config(hf_cfg, ModelConfig(), folder)
    return arch.from_hf(read_hf_weights(folder), model_cfg, source), folder


def load_hf_weights(model: Transformer, path: str | Path) -> None:
    """Copy a Hugging Face folder's weights into `model` (built with its shape).

    Raises:
        InputError: the folder's architecture cannot be held.
        CheckpointError: a missing, unexpected or mis-shaped tensor (named).
    """
    ours, folder = hf_weights(path)
    load_weights(model, ours, folder)


def model_config(hf_cfg: dict[str, Any], base: ModelConfig, folder: Path) -> ModelConfig:
    """llmcli's `ModelConfig` for a folder's `config.json` (`base` gives what it leaves open).

    Raises:
        InputError: an architecture or features llmcli's model cannot hold (named).
    """
    source = str(folder / HF_CONFIG_FILE)
    arch = for_model_type(hf_cfg.get("model_type"), source)
    return arch.model_config(hf_cfg, base, source)


@dataclass
class HFFolder:
    """A Hugging Face model folder loaded as llmcli objects."""

    path: Path
    model_config: ModelConfig
    tokenizer: Tokenizer
    model: Transformer
    hf_config: dict[str, Any]


def load_hf_folder(
    path: str | Path, *, base: ModelConfig | None = None, device: str = "cpu"
) -> HFFolder:
    """Load a Hugging Face model folder as an llmcli model (eval mode) and tokenizer.

    Args:
        path: the folder (config.json, weights, tokenizer.json).
        base: model options the folder leaves open (dropout); default `ModelConfig()`.
        device: where to put the model.

    Raises:
        InputError: not a model folder, an architecture or option llmcli cannot hold, a
            vocabulary mismatch, bad weights (each message names the file and what to fix).
    """
    folder, hf_cfg = check_hf_folder(path)
    model_cfg = model_config(hf_cfg, base or ModelConfig(), folder)
    tokenizer = _load_folder_tokenizer(folder, hf_cfg)
    model = Transformer(model_cfg, tokenizer.vocab_size)
    load_hf_weights(model, folder)
    model.to(device)
    model.eval()
    return HFFolder(folder, model_cfg, tokenizer, model, hf_cfg)


def resolve_init_from(config: Config) -> Config:
    """The config of a run that starts from `train.init_from` (a Hugging Face model folder).

    `model` takes the folder's architecture (keeping `dropout`), `data.tokenizer` becomes the
    folder's `tokenizer.json` (used as is) and `train.init_from` its absolute path, so the
    resolved config written into the run describes the model exactly (sample and resume need
    nothing else). The weights are copied by `load_hf_weights` once the model is built.

    Raises:
        InputError: not a model folder, an inexpressible option or a vocabulary mismatch.
    """
    folder, hf_cfg = check_hf_folder(config.train.init_from)
    model_cfg = model_config(hf_cfg, config.model, folder)
    _load_folder_tokenizer(folder, hf_cfg)
    folder = folder.resolve()
    data = dataclasses.replace(config.data, tokenizer=str(folder / HF_TOKENIZER_FILE))
    return config_from_base(config, model_cfg, data, folder, "init_from")


def config_from_base(
    config: Config, model: ModelConfig, data: DataConfig, base: Path, what: str
) -> Config:
    """`config` with the base's model shape and data settings and `train.init_from` its
    absolute path, validated; what changed in the model is logged, `what` naming the base."""
    resolved = dataclasses.replace(
        config,
        model=model,
        data=data,
        train=dataclasses.replace(config.train, init_from=str(base)),
    )
    resolved.validate()
    changed = [
        f"model.{k}={v!r}"
        for k, v in dataclasses.asdict(model).items()
        if getattr(config.model, k) != v
    ]
    logger.info("%s '%s': %s", what, base, ", ".join(changed) or "model shape unchanged")
    return resolved
