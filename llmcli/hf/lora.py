"""A LoRA run's adapters in PEFT's format, for the Hugging Face export's layouts.

PEFT (`peft.PeftModel.from_pretrained(base, folder)`) reads a folder of `adapter_config.json`
and `adapter_model.safetensors`. Its tensors are named after the base model's modules with the
prefix `base_model.model.` and the adapter's name left out:
`base_model.model.transformer.h.0.attn.c_attn.lora_A.weight` `(r, in)` and `...lora_B.weight`
`(out, r)`, PEFT's `nn.Linear` layers, in the same shapes as `llmcli.model.lora.LoRALinear`'s
`A` and `B` whatever the base layer is.

Each architecture module says where an adapter goes (`lora_to_hf`) and whether its weights are
`(in, out)` (`LORA_FAN_IN_FAN_OUT`):
- GPT-2: the same modules as the weights; its projections are `Conv1D` (`x @ W`, `W (in,
  out)`), which the config says with `fan_in_fan_out: true` (PEFT then transposes only the
  merged update, `(B A)^T`). The targets are named by their parents (`attn.c_proj`,
  `mlp.c_proj`), since PEFT matches a name by its end and both output projections are `c_proj`.
- GPT-NeoX: the fused QKV's `B` rows reordered by head as its weight's rows are; `A` as it is.
- Arcee: the fused QKV is `q_proj`, `k_proj`, `v_proj`, so its adapter becomes three that share
  `A`, each with its third of `B`'s rows.

Tokens the run added to the base's vocabulary (the chat tokens) train their rows of the token
embedding beside the adapters. PEFT holds such rows as trainable tokens: the config lists their
ids (`trainable_token_indices`) and the file their trained values, which replace the base's rows
(`<embedding>.token_adapter.trainable_tokens_delta`, `(new tokens, C)`; `LORA_EMBEDDING` names
the embedding). The base must then have those rows: the export writes it with the vocabulary
grown as the run grew it (`llmcli.training.init_from.grow_vocab`: each new row the mean of the
base's). PEFT's trainable tokens reach the embedding only, so a run with an untied LM head that
adds tokens is exported merged.

The layout is the one `llmcli export --format auto` picks for the run's model: only one
architecture computes a given model exactly, so a run's adapters have one layout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import save

from llmcli.config import LoraConfig, ModelConfig
from llmcli.errors import CheckpointError, InputError
from llmcli.hf.architectures import choose
from llmcli.model.gpt import Transformer
from llmcli.model.lora import adapted_layers, add_lora, grow_rows, token_row_params
from llmcli.runs.directory import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    BEST_ADAPTER_FILE,
    STATE_FILE,
)
from llmcli.runs.formats import check_weights, load_state, load_weights, read_weights

PREFIX = "base_model.model."
# The block part of a module's name (`transformer.h.0.`, `model.layers.12.`): target_modules
# name what follows, which PEFT matches in every block.
_BLOCK = re.compile(r"^.*?\.\d+\.")


def peft_config(
    lora: LoraConfig,
    arch: ModuleType,
    modules: list[str],
    base: str | None = None,
    new_tokens: list[int] | None = None,
) -> dict[str, Any]:
    """`adapter_config.json` for adapters on `modules` (PEFT's names, without the prefix) of
    the `arch` layout (`base`: the base model's folder or Hub name, which PEFT records and
    `AutoPeftModelForCausalLM` loads; `new_tokens`: the ids whose embedding rows train)."""
    targets = sorted({_BLOCK.sub("", module) for module in modules})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,  # e.g. "attn.c_attn": PEFT matches the end of a name
        "fan_in_fan_out": arch.LORA_FAN_IN_FAN_OUT,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        # a list: the rows of the model's input embedding
        "trainable_token_indices": new_tokens or None,
    }


def peft_tensors(
    model: torch.nn.Module, arch: ModuleType, base_vocab: int | None = None
) -> dict[str, torch.Tensor]:
    """Every adapter's `A (r, in)` and `B (out, r)` under PEFT's names for `arch`'s layout (an
    adapter split over several modules gives each the same `A`), and the token embedding's
    rows from `base_vocab` on, when the model has more (the trainable tokens' values)."""
    out = {}
    for name, layer in adapted_layers(model):
        A = layer.lora_A.detach().cpu().contiguous()
        B = layer.lora_B.detach().cpu()
        for module, rows in arch.lora_to_hf(name, B, model.n_head).items():
            out[f"{PREFIX}{module}.lora_A.weight"] = A.clone()  # safetensors shares no memory
            out[f"{PREFIX}{module}.lora_B.weight"] = rows.contiguous()
    if base_vocab is not None and base_vocab < model.vocab_size:
        rows = model.wte.weight.detach()[base_vocab:].cpu().contiguous()  # (new tokens, C)
        out[f"{PREFIX}{arch.LORA_EMBEDDING}.{_TOKEN_DELTA}"] = rows
    return out


# What follows the embedding's name in PEFT's name of the trainable tokens' values.
_TOKEN_DELTA = "token_adapter.trainable_tokens_delta"


def peft_adapter_files(
    model: torch.nn.Module,
    lora: LoraConfig,
    arch: ModuleType,
    base: str | None = None,
    base_vocab: int | None = None,
) -> dict[str, bytes]:
    """The adapter folder's two files, `adapter_config.json` and `adapter_model.safetensors`,
    by name, for the caller to write (atomically, with its own errors). `base_vocab`: the
    base's vocabulary size, when the run added tokens after it (see the module's docstring)."""
    tensors = peft_tensors(model, arch, base_vocab)
    modules = [name.removeprefix(PREFIX).rsplit(".", 2)[0] for name in tensors if ".lora_" in name]
    new_tokens = list(range(base_vocab, model.vocab_size)) if base_vocab is not None else None
    config = peft_config(lora, arch, modules, base, new_tokens)
    return {
        ADAPTER_CONFIG_FILE: (json.dumps(config, indent=2) + "\n").encode("utf-8"),
        ADAPTER_FILE: save(tensors, metadata={"format": "pt"}),  # as PEFT saves them
    }


def adapter_layout(model: torch.nn.Module, model_cfg: ModelConfig) -> ModuleType | None:
    """The architecture whose layout a run's adapters are written in (the one the export picks),
    or None when they cannot be: no architecture computes the model, or an untied LM head's
    rows train beside the adapters (PEFT's trainable tokens reach the embedding only)."""
    head = token_row_params(model).get("lm_head.weight")
    if head is not None and head.requires_grad:
        return None
    try:
        return choose(model_cfg)
    except InputError:
        return None


def saved_adapted_model(
    run_dir: Path, model_cfg: ModelConfig, lora: LoraConfig, step: int | None = None
) -> Transformer:
    """A LoRA run's model unmerged: the base's weights as the run loaded them (frozen, so
    bitwise `train.init_from`'s) from the resume state, with the adapters beside them of its
    last save, or of step `step` from `best_adapter.safetensors` (the best step's).

    Raises:
        CheckpointError: a missing or damaged file, one that does not fit the config, or best
            adapters of another step than `step`.
    """
    path = run_dir / STATE_FILE
    tensors = load_state(path).get("model")
    if not isinstance(tensors, dict) or "wte.weight" not in tensors:
        raise CheckpointError(f"resume state '{path}' holds no model weights: it is damaged.")
    # Initial values are all replaced; a generator of their own leaves torch's global one be.
    gen = torch.Generator().manual_seed(0)
    model = Transformer(model_cfg, tensors["wte.weight"].shape[0], generator=gen)
    add_lora(model, lora, gen)
    load_weights(model, tensors, path)
    if step is not None:
        best = run_dir / BEST_ADAPTER_FILE
        adapters, meta = read_weights(best)
        if meta.get("step") != str(step):
            raise CheckpointError(
                f"'{best}' holds the adapters of step {meta.get('step')}, not of the best "
                f"weights' step {step}: a save was cut short. Export --weights last."
            )
        check_weights(model, {**tensors, **adapters}, best)
        with torch.no_grad():
            model.load_state_dict(adapters, strict=False)
    return model.eval()


def restore_base_rows(model: Transformer, base_vocab: int) -> None:
    """Put back, in place, the token embedding's rows from `base_vocab` on as the run started
    them (the base's mean row): the base a LoRA export writes, whose trained rows are the
    adapter's trainable tokens. Bitwise the run's start, as the base's rows are frozen."""
    if base_vocab < model.vocab_size:
        with torch.no_grad():
            base_rows = model.wte.weight[:base_vocab]  # (V0, C)
            model.wte.weight.copy_(grow_rows(base_rows.clone(), model.vocab_size))
