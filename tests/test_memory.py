"""Memory estimates and checks before training (llmcli/training/memory.py)."""

from __future__ import annotations

import pytest
import torch

from llmcli.config import config_from_dict
from llmcli.errors import InputError
from llmcli.training.memory import check_memory, estimate_training_bytes


@pytest.mark.parametrize(
    "model",
    [
        {},
        {"tie_embeddings": False},
        {"pos_emb": "rope"},
        {"n_layer": 3, "n_embed": 48, "n_head": 4},
    ],
)
def test_memory_estimate_counts_the_parameters_and_refuses_what_cannot_fit(model: dict) -> None:
    from llmcli.model.gpt import Transformer

    model_cfg = {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 8}
    config = config_from_dict({"model": model_cfg, "train": {"batch_size": 4}}, name="t")
    for key, value in model.items():
        setattr(config.model, key, value)
    n_params, need = estimate_training_bytes(config, 50)
    assert n_params == Transformer(config.model, 50).num_parameters()
    assert need > 16 * n_params
    check_memory(config, 50, torch.device("cpu"))  # fits
    config.model.n_embed, config.model.n_head = 4_000_000_000, 1
    with pytest.raises(InputError, match=r"needs about [\d,.]+ GiB .* lower model.n_embed"):
        check_memory(config, 50, torch.device("cpu"))
