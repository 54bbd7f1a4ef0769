"""A LoRA run's adapters in PEFT's format, for the Hugging Face export's GPT-2 layout.

PEFT (`peft.PeftModel.from_pretrained(base, folder)`) reads a folder of `adapter_config.json`
and `adapter_model.safetensors`. Its tensors are named after the base model's modules with the
prefix `base_model.model.` and the adapter's name left out:
`base_model.model.transformer.h.0.attn.c_attn.lora_A.weight` `(r, in)` and `...lora_B.weight`
`(out, r)`, PEFT's `nn.Linear` layers, in the same shapes as `llmcli.model.lora.LoRALinear`'s
`A` and `B` whatever the base layer is. GPT-2's projections are `Conv1D` (`x @ W`, `W (in,
out)`), which the config says with `fan_in_fan_out: true`: PEFT then transposes only the merged
update, `(B A)^T`. The targets are named by their parents too (`attn.c_proj`, `mlp.c_proj`),
since PEFT matches a name by its end and both blocks' output projections are `c_proj`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from llmcli.config import LoraConfig, ModelConfig
from llmcli.fileio import atomic_write_bytes, atomic_write_text
from llmcli.hf.gpt2 import hf_name, problems
from llmcli.model.lora import adapted_layers, token_row_params
from llmcli.runs.directory import ADAPTER_CONFIG_FILE, ADAPTER_FILE

PREFIX = "base_model.model."


def peft_config(lora: LoraConfig, base: str | None = None) -> dict[str, Any]:
    """`adapter_config.json` for adapters on GPT-2's layers (`base`: the base model's folder or
    Hub name, which PEFT records and does not need)."""
    targets = [hf_name(f"blocks.0.{target}.weight").split(".", 3)[3] for target in lora.targets]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        # e.g. "attn.c_attn": PEFT matches the end of a module's name
        "target_modules": [name.removesuffix(".weight") for name in targets],
        "fan_in_fan_out": True,  # GPT-2's Conv1D holds W as (in, out)
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def peft_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter's `A (r, in)` and `B (out, r)` under PEFT's names for GPT-2's layout."""
    out = {}
    for name, layer in adapted_layers(model):
        module = PREFIX + hf_name(f"{name}.weight").removesuffix(".weight")
        out[f"{module}.lora_A.weight"] = layer.lora_A.detach().cpu().contiguous()
        out[f"{module}.lora_B.weight"] = layer.lora_B.detach().cpu().contiguous()
    return out


def write_peft_adapter(
    folder: str | Path, model: torch.nn.Module, lora: LoraConfig, base: str | None = None
) -> None:
    """Write `adapter_config.json` and `adapter_model.safetensors` into `folder` (which
    exists), each file renamed into place."""
    folder = Path(folder)
    atomic_write_text(folder / ADAPTER_CONFIG_FILE, json.dumps(peft_config(lora, base), indent=2))
    weights = save(peft_tensors(model), metadata={"format": "pt"})  # as PEFT saves them
    atomic_write_bytes(folder / ADAPTER_FILE, weights)


def writes_peft_adapter(model: torch.nn.Module, model_cfg: ModelConfig) -> bool:
    """Whether a run's adapters can be written in PEFT's format here: the model is GPT-2's
    architecture, and no token rows train beside the adapters (PEFT's trainable tokens are not
    written yet, and without them the adapter would not fit the base's vocabulary)."""
    rows_train = any(p.requires_grad for p in token_row_params(model).values())
    return not problems(model_cfg) and not rows_train
