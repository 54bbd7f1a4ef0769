"""Shared by the attention tests: a small hand-made dump, and a small model with distinct heads."""

from __future__ import annotations

import numpy as np
import torch

from llmcli.inspection.dump import AttentionDump
from llmcli.inspection.metrics import METRIC_NAMES, head_metrics


def make_dump(T: int = 6, L: int = 2, H: int = 3) -> AttentionDump:
    rng = np.random.default_rng(1)
    attn = rng.random((L, H, T, T)) * np.tril(np.ones((T, T)))  # (L, H, T, T), causal
    attn /= attn.sum(-1, keepdims=True)
    tokens = ["<", "/script>", " ", "\n", "é", "&"][:T]
    metrics = head_metrics(attn).astype(np.float32)
    return AttentionDump(
        attn=attn.astype(np.float32),
        tokens=tokens,
        token_ids=np.arange(T),
        metrics=metrics,
        metric_names=list(METRIC_NAMES),
        layers=[0, 2],
        heads=[0, 1, 3][:H],
        meta={"prompt": "".join(tokens), "checkpoint": "/x"},
    )


CORPUS = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved.\n"
) * 3
CTX = 16


def build_model(seed: int = 0, **model_overrides):
    """A small Transformer with sharpened query/key weights, so heads differ visibly."""
    from llmcli.config import config_from_dict
    from llmcli.data.tokenizer import CharTokenizer
    from llmcli.model.gpt import Transformer

    tok = CharTokenizer.train([CORPUS])
    model_cfg = {"n_layer": 2, "n_head": 4, "n_embed": 32, "context_length": CTX, **model_overrides}
    config = config_from_dict({"model": model_cfg, "data": {"val_fraction": 0.25}})
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config.model, tok.vocab_size, generator=gen)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.normal_(0.0, 0.4, generator=gen)
    model.eval()
    return config, tok, model
