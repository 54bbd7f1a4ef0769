"""`train.init_from`: start a run from an llmcli run directory or a Hugging Face folder.

A folder that holds `config.yaml` is an llmcli run (`llmcli.runs.directory`): the model's shape
comes from its config (the fine-tune's `model.dropout` and `attn_dropout` kept, as for a Hugging
Face folder), the tokenizer is its `tokenizer.json`, the weights its `best.safetensors` (else
`model.safetensors`: what `llmcli sample` reads), through safetensors only. With
`data.format: chat`, `preference` or `prompts` (an objective whose rows are `templated`) and no
`data.chat_template`, a run that holds a chat template passes it on;
`llmcli.objectives.base.init_encoding` loads the two that pairs and prompts are encoded with.
`reference_model` is DPO's (and GRPO's KL penalty's) frozen reference: these weights again.
Anything else is a Hugging Face folder or Hub name (`llmcli.hf.load`).

With `data.format: chat` the tokenizer gains the chat tokens at new ids after its last
(`llmcli.data.conversations.add_chat_tokens`), so the model has more rows than the weights:
`grow_vocab` gives each new row of every vocabulary-sized tensor (the token embedding, and the
LM head when it is untied) the mean of the existing rows, a start that predicts and embeds like
an average token rather than a random one. The existing rows are copied unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from llmcli.config import Config
from llmcli.data.chat_template import TEMPLATE_FILE
from llmcli.errors import CheckpointError
from llmcli.hf.load import config_from_base, hf_weights
from llmcli.hf.load import resolve_init_from as resolve_hf_init_from
from llmcli.model.gpt import Transformer
from llmcli.model.lora import grow_rows
from llmcli.objectives import objective_for
from llmcli.runs.directory import CONFIG_FILE, TOKENIZER_FILE
from llmcli.runs.formats import load_weights, read_weights
from llmcli.runs.loading import load_config_file, load_tokenizer_file, run_weights_path

logger = logging.getLogger(__name__)


def is_run_dir(path: str | Path) -> bool:
    """Whether `path` is an llmcli run directory (it holds `config.yaml`), not a Hugging Face
    folder (`config.json`) or Hub name."""
    return (Path(path).expanduser() / CONFIG_FILE).is_file()


def resolve_init_from(config: Config) -> Config:
    """The config of a run that starts from `train.init_from`.

    `model` takes the base's shape, `data.tokenizer` becomes the base's `tokenizer.json` and
    `train.init_from` its absolute path, so that the resolved config written into the run
    describes the model exactly; the weights are copied by `load_init_weights` once the model
    is built.

    Raises:
        InputError: not a run or a model folder (CheckpointError: an incomplete run), an
            inexpressible option or a vocabulary mismatch.
    """
    spec = config.train.init_from
    assert spec, "resolve_init_from needs train.init_from"
    if not is_run_dir(spec):
        return resolve_hf_init_from(config)
    run_dir = Path(spec).expanduser().resolve()
    base = load_config_file(run_dir)
    load_tokenizer_file(run_dir)  # readable, before any data is read
    run_weights_path(run_dir)  # and it has weights
    model = dataclasses.replace(
        base.model, dropout=config.model.dropout, attn_dropout=config.model.attn_dropout
    )
    data = dataclasses.replace(config.data, tokenizer=str(run_dir / TOKENIZER_FILE))
    template = run_dir / TEMPLATE_FILE
    templated = objective_for(config).templated  # its rows are encoded with a chat template
    if templated and data.chat_template is None and template.is_file():
        data = dataclasses.replace(data, chat_template=str(template))
    return config_from_base(config, model, data, run_dir, "init_from run")


def load_init_weights(model: Transformer, init_from: str) -> None:
    """Copy `train.init_from`'s weights into `model` (built with its shape), the rows of tokens
    the base's vocabulary lacks set to the mean of its rows (`grow_vocab`).

    Raises:
        CheckpointError: bad weights, or a tensor missing, unexpected or mis-shaped (named).
        InputError: a Hugging Face architecture llmcli cannot hold.
    """
    if is_run_dir(init_from):
        run_dir = Path(init_from).expanduser()
        source = run_weights_path(run_dir)
        tensors, _ = read_weights(source)
        base_vocab = int(load_tokenizer_file(run_dir).vocab_size)
        rows = tensors.get("wte.weight")
        if isinstance(rows, torch.Tensor) and rows.shape[0] != base_vocab:
            raise CheckpointError(
                f"the weights '{source}' hold {rows.shape[0]} token rows but the run's "
                f"tokenizer has {base_vocab} tokens: the files come from different runs."
            )
    else:
        tensors, source = hf_weights(init_from)
    load_weights(model, grow_vocab(tensors, model), source)


def grow_vocab(tensors: dict[str, Any], model: Transformer) -> dict[str, Any]:
    """`tensors` with every vocabulary-sized tensor that has fewer rows than `model`'s
    vocabulary given the missing rows, each the mean of its existing rows.

    Args:
        tensors: weights under llmcli's names, e.g. `wte.weight` `(V0, C)`.
        model: the model they go into, of `vocab_size` V >= V0.

    Returns:
        The same mapping with `(V, ...)` tensors where the model has V rows and the weights
        V0 < V: rows `:V0` as they were, rows `V0:` the mean of those.
    """
    expected, V = model.state_dict(), model.vocab_size
    grown = dict(tensors)
    for name, tensor in tensors.items():
        want = expected.get(name)
        if (
            want is None
            or not isinstance(tensor, torch.Tensor)
            or tensor.ndim == 0
            or want.shape[0] != V
            or not 0 < tensor.shape[0] < V
            or want.shape[1:] != tensor.shape[1:]
        ):
            continue
        grown[name] = grow_rows(tensor, V)  # (V, ...)
        logger.info(
            "init_from: %s grows from %d to %d rows (new tokens start as the mean row)",
            name,
            tensor.shape[0],
            V,
        )
    return grown


def reference_model(config: Config, vocab_size: int, device: torch.device) -> Transformer:
    """The frozen reference: `train.init_from`'s weights (as the policy starts from them, also
    when a run resumes), in eval mode (no dropout) and without gradients."""
    assert config.train.init_from, "DPO's reference is train.init_from's model"
    reference = Transformer(config.model, vocab_size)
    load_init_weights(reference, config.train.init_from)
    reference.to(device).eval()
    reference.requires_grad_(False)
    return reference
