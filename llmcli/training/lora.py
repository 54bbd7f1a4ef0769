"""`train.lora`: a run that trains low-rank adapters on its frozen `train.init_from` model.

`adapt` turns the model a run built into the one it trains: adapters on the targeted layers
(`llmcli.model.lora`), every base parameter frozen but the rows of tokens the run added to the
base's vocabulary (the chat tokens). The optimizer then gets only what trains, and the step
clips only that. The objective is untouched: next-token text and chat, and DPO, whose frozen
reference is built apart from the policy without adapters (`llmcli.objectives.dpo`).

What a LoRA run saves: `model.safetensors` and `best.safetensors` hold the merged weights (the
plain model the adapted one equals), so every reader of a run works on it unchanged; the
resume state holds the adapters unmerged with their optimizer state, so a resumed run goes on
exactly.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from llmcli.config import LoraConfig, TrainConfig
from llmcli.hf.load import check_hf_folder
from llmcli.model.gpt import Transformer
from llmcli.model.lora import add_lora, freeze_base, lora_parameters, train_token_rows
from llmcli.runs.loading import load_tokenizer_file
from llmcli.training.init_from import is_run_dir

logger = logging.getLogger(__name__)

# Offsets the adapters' initial values from the weights' seed: another stream of numbers.
LORA_SEED_OFFSET = 7919


def adapt(model: Transformer, lora: LoraConfig, init_from: str, seed: int) -> list[str]:
    """Make `model` (built with `init_from`'s shape) a LoRA model to train, in place: adapters
    on `lora.targets` (their `A` drawn from `seed`), the base frozen but for the rows of the
    tokens `init_from`'s vocabulary lacks.

    Returns:
        The names of the matrices whose new rows train (none when the vocabulary did not grow):
        they must not be weight-decayed, or their frozen rows would shrink.

    Raises:
        InputError: a rank larger than a layer.
    """
    add_lora(model, lora, torch.Generator().manual_seed(seed + LORA_SEED_OFFSET))
    freeze_base(model)
    base_vocab = base_vocab_size(init_from)
    rows = train_token_rows(model, base_vocab)
    counts = parameter_counts(model, base_vocab)
    logger.info(
        "LoRA: %s adapter parameters (rank %d on %s)%s; %s of %s parameters train",
        f"{counts['adapters']:,}",
        lora.rank,
        ", ".join(lora.targets),
        f", and the new token rows of {', '.join(rows)}" if rows else "",
        f"{counts['trainable']:,}",
        f"{model.num_parameters():,}",
    )
    return rows


def adapt_model(model: Transformer, train: TrainConfig) -> list[str]:
    """`adapt` with `train.lora` (the one place that asks whether a run has adapters); a run
    without trains every weight, and no matrix's rows are kept from weight decay."""
    if train.lora is None:
        return []
    assert train.init_from, "train.lora needs train.init_from"
    return adapt(model, train.lora, train.init_from, train.seed)


def trains_base(model: Transformer) -> bool:
    """Whether the model's own weights train (no adapters on a frozen base)."""
    return not lora_parameters(model)


def lora_meta(model: Transformer, init_from: str | None) -> dict[str, dict[str, int]]:
    """`meta.json`'s `lora` row of an adapted model (`parameter_counts`); none for a model
    without adapters."""
    if not lora_parameters(model) or not init_from:
        return {}
    return {"lora": parameter_counts(model, base_vocab_size(init_from))}


def parameter_counts(model: Transformer, base_vocab: int) -> dict[str, int]:
    """An adapted model's `adapters` (every A and B) and `trainable` parameters (the adapters,
    and the token matrices whose new rows train: whole, as their gradients are), and the base's
    `base_vocab_size` (the tokens from it on are the run's own, whose rows train), which
    `meta.json` records as `lora`."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "adapters": lora_parameters(model),
        "trainable": trainable,
        "base_vocab_size": base_vocab,
    }


def base_vocab_size(init_from: str) -> int:
    """The vocabulary of the model a run starts from: an llmcli run's tokenizer, or a Hugging
    Face folder's `config.json` `vocab_size` (the rows of its embedding)."""
    if is_run_dir(init_from):
        return int(load_tokenizer_file(Path(init_from).expanduser()).vocab_size)
    _, hf_cfg = check_hf_folder(init_from)
    return int(hf_cfg["vocab_size"])
