"""Shared by the Hugging Face tests: a tiny run with random weights, the text it is tried on,
comparisons that print their difference, and the CLI run in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmcli.cli import main
from llmcli.config import Config, DataConfig, ModelConfig
from llmcli.data.tokenizer import BPETokenizer, CharTokenizer
from llmcli.model.gpt import Transformer
from llmcli.runs.directory import save_model_run

TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die than to famish?\n"
    "\nAll:\nResolved. resolved.\n\nFirst Citizen:\nFirst, you know Caius Marcius is chief enemy "
    "to the people.\n\nAll:\nWe know't, we know't.\n\nFirst Citizen:\nLet us kill him, and we'll "
    "have corn at our own price.\nIs't a verdict?\n"
)
PROMPT = "First Citizen:\nSpeak"


def assert_close(actual, expected, name: str, atol: float = 1e-5) -> None:
    diff = (actual.detach() - expected.detach()).abs().max().item()
    print(f"max_abs_diff {name}: {diff:.3e}")
    torch.testing.assert_close(actual.detach(), expected.detach(), atol=atol, rtol=1e-5)


def cli(*args: str) -> int:
    """Run the CLI in-process; returns its exit status."""
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    return exc.value.code


def make_tokenizer(kind: str):
    return CharTokenizer.train([TEXT]) if kind == "char" else BPETokenizer.train([TEXT], 300)


def make_run(run_dir: Path, kind: str = "char", seed: int = 0, **model_opts) -> Path:
    """A run directory holding a tiny model with random, non-trivial weights (no training)."""
    tok = make_tokenizer(kind)
    model_cfg = ModelConfig(n_layer=2, n_head=4, n_embed=32, context_length=96, **model_opts)
    config = Config(model=model_cfg, data=DataConfig(tokenizer=kind))
    g = torch.Generator().manual_seed(seed)
    model = Transformer(model_cfg, tok.vocab_size, generator=g)
    with torch.no_grad():  # well-separated logits, so greedy decoding has no near ties
        for name, p in model.named_parameters():
            gain = name.endswith("weight") and p.ndim == 1
            p.copy_((1.0 if gain else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    save_model_run(run_dir, config, tok, model)
    return run_dir


def greedy_llmcli(model: Transformer, ids: list[int], n: int) -> list[int]:
    """Plain argmax loop over `model.forward` (no cache): the reference greedy decoder."""
    idx = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx[:, -model.context_length :])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx[0, len(ids) :].tolist()
