"""Hugging Face interoperability: how llmcli's model maps onto GPT-2 (`GPT2LMHeadModel`).

llmcli's default `Transformer` is GPT-2's architecture, so the mapping is a renaming:

| llmcli | Hugging Face `GPT2LMHeadModel` |
| --- | --- |
| `wte`, `wpe` | `transformer.wte`, `transformer.wpe` |
| `blocks.{i}.ln1`, `blocks.{i}.ln2` | `transformer.h.{i}.ln_1`, `transformer.h.{i}.ln_2` |
| `blocks.{i}.attn.qkv`, `.attn.proj` | `transformer.h.{i}.attn.c_attn`, `.attn.c_proj` |
| `blocks.{i}.mlp.fc`, `.mlp.proj` | `transformer.h.{i}.mlp.c_fc`, `.mlp.c_proj` |
| `ln_f`, `lm_head` | `transformer.ln_f`, `lm_head` |

GPT-2's projections are `Conv1D` layers, `y = x @ W + b` with `W` of shape `(in, out)`, the
transpose of `nn.Linear`'s `(out, in)`. Both fuse the query, key and value projections in the same
order (queries, then keys, then values, each head-major), so only the transpose is needed.
GPT-2 always has biases; a run trained with `model.bias: false` is exported with zero biases,
which computes exactly the same function.

What GPT-2 cannot express is refused with a message naming the option: rotary position
embeddings (`model.pos_emb: rope`), RMSNorm (`model.norm: rmsnorm`) and QK-norm
(`model.qk_norm: true`). The ReLU² MLP (`model.mlp: relu2`) is GPT-2's
`activation_function="relu2"`, and an untied LM head is `tie_word_embeddings=false`.

"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from llmcli.config import ModelConfig
from llmcli.errors import CheckpointError, InputError
from llmcli.hf.common import (
    NORM_EPS,
    Problem,
    activation,
    bias_or_zeros,
    config_file,
    cpu,
    field,
    mismatches,
    model_shape,
    refuse,
    warn_eps,
)
from llmcli.model.gpt import Transformer

logger = logging.getLogger(__name__)

NAME = "gpt2"
MODEL_TYPE = "gpt2"
HF_CLASS = "GPT2LMHeadModel"
# Buffers that old GPT-2 checkpoints saved (the causal mask), not weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


# ---------------------------------------------------------------------------------------------
# Architecture: what maps, and how the names and shapes correspond
# ---------------------------------------------------------------------------------------------


def problems(model_cfg: ModelConfig) -> list[Problem]:
    """The options GPT-2 cannot compute exactly (none: it can export the run)."""
    return mismatches(model_cfg, "GPT-2", pos_emb="learned", norm="layernorm")


def hf_name(name: str) -> str:
    """llmcli parameter name -> Hugging Face GPT-2 name (`blocks.0.attn.qkv.weight` ->
    `transformer.h.0.attn.c_attn.weight`)."""
    if name == "lm_head.weight":
        return name
    parts = name.split(".")
    if parts[0] == "blocks":
        module = {
            "ln1": "ln_1",
            "ln2": "ln_2",
            "attn.qkv": "attn.c_attn",
            "attn.proj": "attn.c_proj",
            "mlp.fc": "mlp.c_fc",
            "mlp.proj": "mlp.c_proj",
        }
        inner = ".".join(parts[2:-1])
        return f"transformer.h.{parts[1]}.{module[inner]}.{parts[-1]}"
    return "transformer." + name


def lora_to_hf(name: str, B: torch.Tensor, n_head: int) -> dict[str, torch.Tensor]:
    """An adapted layer (`blocks.0.attn.qkv`) -> the GPT-2 module its adapter goes on, with its
    `B (out, r)` as it is: GPT-2's fused QKV orders its rows as llmcli's (`n_head` unused)."""
    return {hf_name(f"{name}.weight").removesuffix(".weight"): B}


# PEFT's `fan_in_fan_out`: GPT-2's Conv1D holds W as (in, out), so PEFT transposes the update.
LORA_FAN_IN_FAN_OUT = True
# The token embedding, whose rows a LoRA run adds train as PEFT's trainable tokens.
LORA_EMBEDDING = "transformer.wte"


def _is_conv1d(hf_name: str) -> bool:
    return hf_name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))


def to_hf(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face GPT-2 names and layouts (CPU, contiguous).

    Linear weights `(out, in)` become `Conv1D` weights `(in, out)`; missing biases (a model with
    `bias=False`) become zeros. The LM head is included only when untied.

    Raises:
        InputError: the model uses an option GPT-2 cannot express (see `problems`).
    """
    if model.wpe is None:
        raise InputError("GPT-2 has learned positions: this model is rotary (model.pos_emb).")
    out: dict[str, torch.Tensor] = {}
    for mod_name, module in model.named_modules():
        is_linear = isinstance(module, torch.nn.Linear)
        if not (is_linear or isinstance(module, (torch.nn.LayerNorm, torch.nn.Embedding))):
            if any(True for _ in module.parameters(recurse=False)):
                raise InputError(
                    f"layer '{mod_name}' ({type(module).__name__}) has no GPT-2 "
                    "equivalent (RMSNorm? set model.norm: layernorm)."
                )
            continue
        if mod_name == "lm_head" and model.tie_embeddings:
            continue  # GPT-2 ties it to transformer.wte.weight
        weight = cpu(module.weight)
        hf_weight = hf_name(f"{mod_name}.weight")
        out[hf_weight] = weight.t().contiguous() if _is_conv1d(hf_weight) else weight
        if mod_name == "lm_head" or isinstance(module, torch.nn.Embedding):
            continue  # GPT-2's LM head and embeddings have no bias
        n_out = weight.shape[0]  # Linear (out, in) and LayerNorm (C,) alike
        out[hf_name(f"{mod_name}.bias")] = bias_or_zeros(module, n_out)
    return out


def from_hf(
    tensors: dict[str, torch.Tensor], model_cfg: ModelConfig, source: str = "weights"
) -> dict[str, torch.Tensor]:
    """Hugging Face GPT-2 weights -> llmcli names and layouts.

    Accepts names with or without the `transformer.` prefix (`GPT2LMHeadModel` / `GPT2Model`
    checkpoints) and ignores the causal-mask buffers old checkpoints saved.

    Raises:
        CheckpointError: a tensor name that is not GPT-2's (names it), or an untied model
            without `lm_head.weight`.
    """
    n_layer, tie_embeddings = model_cfg.n_layer, model_cfg.tie_embeddings
    reverse: dict[str, str] = {}
    for i in range(n_layer):
        for ours, theirs in (
            ("ln1", "ln_1"),
            ("ln2", "ln_2"),
            ("attn.qkv", "attn.c_attn"),
            ("attn.proj", "attn.c_proj"),
            ("mlp.fc", "mlp.c_fc"),
            ("mlp.proj", "mlp.c_proj"),
        ):
            for kind in ("weight", "bias"):
                reverse[f"h.{i}.{theirs}.{kind}"] = f"blocks.{i}.{ours}.{kind}"
    for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):
        reverse[name] = name

    out: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in tensors.items():
        if name == "lm_head.weight":
            if not tie_embeddings:
                out[name] = tensor
            continue  # tied: the same values as wte
        short = name.removeprefix("transformer.")
        if short.endswith(_IGNORED_SUFFIXES) and short not in reverse:
            continue
        if short not in reverse:
            unknown.append(name)
            continue
        out[reverse[short]] = tensor.t() if _is_conv1d(short) else tensor
    if unknown:
        raise CheckpointError(
            f"{source} holds tensors that a GPT-2 model with {n_layer} layers does not have: "
            f"{', '.join(sorted(unknown)[:5])}{' ...' if len(unknown) > 5 else ''}. Is "
            "config.json (n_layer) from the same checkpoint?"
        )
    if not tie_embeddings and "lm_head.weight" not in out:
        raise CheckpointError(
            f"{source} has no lm_head.weight, but config.json says tie_word_embeddings false."
        )
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(
    model_cfg: ModelConfig, vocab_size: int, eot_id: int | None, eps: float = NORM_EPS
) -> dict[str, Any]:
    """The `config.json` of the GPT-2 equivalent of `model_cfg` (a plain dict)."""
    settings = {
        "n_positions": model_cfg.context_length,
        "n_embd": model_cfg.n_embed,
        "n_layer": model_cfg.n_layer,
        "n_head": model_cfg.n_head,
        "n_inner": None,  # 4 * n_embd, as llmcli's MLP
        "activation_function": model_cfg.mlp,  # "gelu" (exact, erf) or "relu2"
        "resid_pdrop": model_cfg.dropout,
        "embd_pdrop": model_cfg.dropout,
        "attn_pdrop": model_cfg.attention_dropout,
        "layer_norm_epsilon": eps,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
    }
    return config_file(HF_CLASS, MODEL_TYPE, vocab_size, settings, eot_id, model_cfg.tie_embeddings)


def model_config(hf_cfg: dict[str, Any], base: ModelConfig, source: str) -> ModelConfig:
    """llmcli's `ModelConfig` for a GPT-2 `config.json` (`base` gives dropout).

    Raises:
        InputError: a missing key, or features llmcli's model cannot hold (all named).
    """
    shape = model_shape(
        hf_cfg,
        source,
        n_embed=("n_embd", "hidden_size"),
        n_head=("n_head", "num_attention_heads"),
        n_layer=("n_layer", "num_hidden_layers"),
        context_length=("n_positions", "n_ctx", "max_position_embeddings"),
    )
    n_embed = shape["n_embed"]
    refused = []
    n_inner = field(hf_cfg, source, "n_inner", int)
    if n_inner is not None and n_inner != 4 * n_embed:
        refused.append(f"n_inner ({n_inner}; llmcli's MLP is 4 * n_embd = {4 * n_embed})")
    if not field(hf_cfg, source, "scale_attn_weights", bool, True):
        refused.append("scale_attn_weights (false; llmcli scales by 1/sqrt(head size))")
    if field(hf_cfg, source, "scale_attn_by_inverse_layer_idx", bool, False):
        refused.append("scale_attn_by_inverse_layer_idx (true)")
    if field(hf_cfg, source, "add_cross_attention", bool, False):
        refused.append("add_cross_attention (true)")
    mlp = activation(hf_cfg, "activation_function", "gelu_new", source)
    if mlp is None:
        refused.append(
            f"activation_function ({hf_cfg.get('activation_function')!r}; llmcli has gelu and "
            "relu2)"
        )
    refuse(source, refused, "GPT-2")
    warn_eps(hf_cfg, "layer_norm_epsilon", source)
    return dataclasses.replace(
        base,
        **shape,
        bias=True,
        pos_emb="learned",
        norm="layernorm",
        qk_norm=False,
        mlp=mlp,
        tie_embeddings=field(hf_cfg, source, "tie_word_embeddings", bool, True),
    )
