"""What every architecture mapping shares: file names, activations, small readers and writers.

An architecture module (`gpt2`, `neox`, `arcee`) maps llmcli's `Transformer` onto one
`transformers` model class and back. Each offers the same functions:

- `problems(model_cfg) -> list[Problem]`: the model options it cannot compute exactly;
- `hf_config(model_cfg, vocab_size, eot_id, eps) -> dict`: its `config.json`;
- `to_hf(model) -> dict[str, Tensor]`: llmcli's weights under its names and layouts;
- `model_config(hf_cfg, base, source) -> ModelConfig`: llmcli's model for its `config.json`;
- `from_hf(tensors, model_cfg, source) -> dict[str, Tensor]`: its weights under llmcli's names.
"""

from __future__ import annotations

import logging
import math
from typing import Any, NamedTuple

import torch
from torch import nn

from llmcli.config import ModelConfig
from llmcli.errors import CheckpointError, InputError

logger = logging.getLogger(__name__)

HF_CONFIG_FILE = "config.json"
HF_GENERATION_FILE = "generation_config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"
HF_TORCH_WEIGHTS = "pytorch_model.bin"
HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_SPECIAL_TOKENS = "special_tokens_map.json"
NORM_EPS = 1e-5  # llmcli's LayerNorm and RMSNorm epsilon (torch.nn.LayerNorm's default)
# `transformers` activation names that are exactly llmcli's model.mlp ("gelu" is the erf GELU).
EXACT_ACTIVATIONS = {"gelu": "gelu", "relu2": "relu2"}
# The tanh approximations of GELU load into the exact GELU (as nanoGPT does with OpenAI's
# weights), with a warning: logits differ slightly.
APPROX_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python_tanh", "gelu_accurate")


class Problem(NamedTuple):
    """A model option an architecture cannot compute, and the setting that it can."""

    option: str  # e.g. "model.qk_norm (true; GPT-NeoX has no query/key normalisation)"
    fix: str  # e.g. "model.qk_norm: false"


_POSITIONS = {"learned": "learned positions", "rope": "rotary positions"}
_NORMS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}


def mismatches(
    model_cfg: ModelConfig, arch: str, *, pos_emb: str, norm: str, qk_note: str = ""
) -> list[Problem]:
    """What keeps `model_cfg` from architecture `arch`, which has `pos_emb` and `norm` and no
    query/key norm (`qk_note` adds why none of its relatives has one either)."""
    found = []
    if model_cfg.pos_emb != pos_emb:
        option = f"model.pos_emb ({model_cfg.pos_emb!r}; {arch} has {_POSITIONS[pos_emb]})"
        found.append(Problem(option, f"model.pos_emb: {pos_emb}"))
    if model_cfg.norm != norm:
        option = f"model.norm ({model_cfg.norm!r}; {arch} uses {_NORMS[norm]})"
        found.append(Problem(option, f"model.norm: {norm}"))
    if model_cfg.qk_norm:
        option = f"model.qk_norm (true; {arch} has no query/key norm{qk_note})"
        found.append(Problem(option, "model.qk_norm: false"))
    return found


def config_file(
    hf_class: str,
    model_type: str,
    vocab_size: int,
    settings: dict[str, Any],
    eot_id: int | None,
    tie_embeddings: bool,
) -> dict[str, Any]:
    """An architecture's `config.json`: its class, model type and vocabulary size, then its own
    `settings` (shape, activation, norm, positions, dropout), then what every export ends with:
    the KV cache on, the end-of-text token as BOS and EOS, head tying, and float32 weights."""
    return {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": vocab_size,
        **settings,
        "use_cache": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "tie_word_embeddings": tie_embeddings,
        "torch_dtype": "float32",
    }


def model_shape(
    hf_cfg: dict[str, Any],
    source: str,
    *,
    n_embed: tuple[str, ...] = ("hidden_size",),
    n_head: tuple[str, ...] = ("num_attention_heads",),
    n_layer: tuple[str, ...] = ("num_hidden_layers",),
    context_length: tuple[str, ...] = ("max_position_embeddings",),
) -> dict[str, int]:
    """llmcli's `n_embed`, `n_head`, `n_layer` and `context_length` from a config's keys (the
    first of each tuple that is present).

    Raises:
        InputError: a key missing or not a positive integer, or heads that do not divide the width.
    """
    shape = {
        "n_embed": positive_int(hf_cfg, source, *n_embed),
        "n_head": positive_int(hf_cfg, source, *n_head),
        "n_layer": positive_int(hf_cfg, source, *n_layer),
        "context_length": positive_int(hf_cfg, source, *context_length),
    }
    if shape["n_embed"] % shape["n_head"]:
        raise InputError(
            f"{source}: {n_embed[0]} ({shape['n_embed']}) is not divisible by {n_head[0]} "
            f"({shape['n_head']})."
        )
    return shape


def positive_int(hf_cfg: dict[str, Any], source: str, *keys: str) -> int:
    """The first of `keys` present in `hf_cfg`, which must be a positive integer.

    Raises:
        InputError: none of the keys is there, or the value is not a positive integer.
    """
    for key in keys:
        value = field(hf_cfg, source, key, int)
        if value is not None:
            if value <= 0:
                raise InputError(f"{source}: {key} ({value!r}) must be a positive integer.")
            return value
    raise InputError(f"{source} lacks {keys[0]}: it is not a complete model config.")


# What each kind of `config.json` value must be, as a message says it.
_KINDS: dict[type, str] = {
    str: "a string",
    int: "an integer",
    float: "a finite number",
    bool: "true or false",
    dict: "a mapping (a JSON object)",
}


def field(hf_cfg: dict[str, Any], source: str, key: str, kind: type, default: Any = None) -> Any:
    """`hf_cfg[key]` checked to be of `kind` (str, int, float, bool or dict), or `default` when
    it is absent or null (as `transformers` reads a null: the class default). A float field
    takes any finite JSON number and returns a float; no field takes a bool but a bool field.
    Every value llmcli reads from a `config.json` goes through here, so a wrong type is a
    message naming the file and the key, never an exception further on.

    Raises:
        InputError: naming `source`, the key, its value and what it must be.
    """
    value = hf_cfg.get(key)
    if value is None:
        return default
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
    else:
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise InputError(f"{source}: {key} ({shown}) must be {_KINDS[kind]}.")
    return float(value) if kind is float else value


def activation(hf_cfg: dict[str, Any], key: str, default: str, source: str) -> str | None:
    """llmcli's `model.mlp` for the config's activation, or None when llmcli has none like it.

    Raises:
        InputError: the activation is not a string.
    """
    name = field(hf_cfg, source, key, str, default)
    if name in EXACT_ACTIVATIONS:
        return EXACT_ACTIVATIONS[name]
    if name in APPROX_GELUS:
        logger.warning(
            "%s: %s %r (tanh-approximated GELU) is loaded into llmcli's exact GELU; logits "
            "differ slightly from the original model's",
            source,
            key,
            name,
        )
        return "gelu"
    return None


def warn_eps(hf_cfg: dict[str, Any], key: str, source: str) -> None:
    """Warn when a config's norm epsilon differs from llmcli's (loaded with llmcli's).

    Raises:
        InputError: the epsilon is not a finite number.
    """
    eps = field(hf_cfg, source, key, float, NORM_EPS)
    if not math.isclose(eps, NORM_EPS):
        logger.warning(
            "%s: %s %r is loaded with llmcli's %g; logits differ slightly",
            source,
            key,
            eps,
            NORM_EPS,
        )


def rope_parameters(
    hf_cfg: dict[str, Any], source: str, partial_default: float = 1.0
) -> dict[str, Any]:
    """The rotary settings of a config written by transformers 4.x or 5.x, as 5.x names them
    (`rope_type`, `rope_theta`, `partial_rotary_factor`). 5.x's `rope_parameters` wins over
    4.x's `rope_scaling`, `rope_theta` (or GPT-NeoX's `rotary_emb_base`) and `rotary_pct`;
    every one present is checked, whichever wins.

    Raises:
        InputError: a setting of the wrong type, or a `rope_theta` that is not positive.
    """
    found: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):  # the later wins
        params = field(hf_cfg, source, key, dict, {})
        where = f"{source}: {key}"
        values = {
            "rope_type": field(params, where, "rope_type", str)
            or field(params, where, "type", str),
            "rope_theta": field(params, where, "rope_theta", float),
            "partial_rotary_factor": field(params, where, "partial_rotary_factor", float),
        }
        found.update({k: v for k, v in values.items() if v is not None})
    theta = field(hf_cfg, source, "rotary_emb_base", float, 1e4)
    theta = found.get("rope_theta", field(hf_cfg, source, "rope_theta", float, theta))
    if theta <= 0:
        raise InputError(f"{source}: rope_theta ({theta!r}) must be a positive number.")
    partial = field(hf_cfg, source, "rotary_pct", float, partial_default)
    return {
        "rope_type": found.get("rope_type", "default"),
        "rope_theta": theta,
        "partial_rotary_factor": found.get("partial_rotary_factor", partial),
    }


def refuse(source: str, refused: list[str], what: str) -> None:
    """Raise `InputError` listing the `refused` features of an architecture `what`, if any."""
    if refused:
        raise InputError(
            f"{source} uses {what} features that llmcli's model cannot hold: "
            + "; ".join(refused)
            + "."
        )


def cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous()


def bias_or_zeros(module: nn.Linear | nn.LayerNorm, size: int) -> torch.Tensor:
    """A layer's bias, or zeros where it has none: a zero bias computes the same function."""
    if module.bias is not None:
        return cpu(module.bias)
    return torch.zeros(size, dtype=module.weight.dtype)


def take(tensors: dict[str, torch.Tensor], name: str, source: str) -> torch.Tensor:
    """`tensors[name]`, or a `CheckpointError` naming the missing tensor."""
    if name not in tensors:
        raise CheckpointError(f"{source} has no tensor {name!r}: is config.json from it?")
    return tensors[name]


def leftovers(tensors: dict[str, torch.Tensor], used: set[str], source: str, what: str) -> None:
    """Refuse tensors a mapping did not use (a config that does not match its weights)."""
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise CheckpointError(
            f"{source} holds tensors that this {what} model does not have: "
            f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}. Is config.json "
            "from the same checkpoint?"
        )
