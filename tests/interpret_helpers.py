"""Shared by the lens, patching and attribution tests: small models of every architecture option,
with a char tokenizer, and hand-run forwards to compare against."""

from __future__ import annotations

import torch
from attention_helpers import CORPUS
from model_helpers import randomize_, tiny_model

from llmcli.data.tokenizer import CharTokenizer

#: Every architecture option llmcli trains, one at a time and all together.
ARCHS = {
    "default": {},
    "rope": {"pos_emb": "rope"},
    "rmsnorm": {"norm": "rmsnorm"},
    "qk_norm": {"qk_norm": True},
    "untied": {"tie_embeddings": False},
    "relu2": {"mlp": "relu2"},
    "all": {
        "pos_emb": "rope",
        "norm": "rmsnorm",
        "qk_norm": True,
        "tie_embeddings": False,
        "mlp": "relu2",
    },
}


def char_model(seed: int = 0, **kwargs):
    """A char tokenizer of the test corpus and a 2-layer model over it, every parameter random
    (biases and norm gains included), in eval mode."""
    tok = CharTokenizer.train([CORPUS])
    model = tiny_model(seed, vocab_size=tok.vocab_size, **kwargs)
    return tok, randomize_(model, seed).eval()


def ids_of(tok, text: str) -> torch.Tensor:
    return torch.tensor([tok.encode(text)])


@torch.no_grad()
def hand_stream(model, idx: torch.Tensor, k: int) -> torch.Tensor:
    """The residual stream after the first `k` blocks, the blocks called one by one with no
    function at any hook point: `(B, T, C)`."""
    x = model.embedding(idx)  # (B, T, C)
    for block in model.blocks[:k]:
        x = block(x)
    return x
