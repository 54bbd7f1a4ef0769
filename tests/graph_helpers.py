"""Shared by the graph tests: a small run with transcoders on every layer, and the prompt's ids."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import torch

from llmcli.inspection.sae.config import SAEConfig
from llmcli.inspection.sae.train import TrainOptions
from llmcli.inspection.sae.transcoder_train import train_transcoders

PROMPT = "To be or not"
ROOT = Path(__file__).resolve().parent.parent


def transcoders_for(run: Path, out: Path, **settings) -> Path:
    """Transcoders of 64 features on every layer of `run`, trained 20 steps (JumpReLU after
    BatchTopK, k 4, with a skip unless told otherwise)."""
    values = {"kind": "transcoder", "features": 64, "k": 4, "steps": 20, "batch_tokens": 128}
    values |= {"activation": "batchtopk", "skip": True, "log_interval": 10}
    train_transcoders(SAEConfig(**{**values, **settings}), TrainOptions(checkpoint=run, out=out))
    return out


def prompt_ids(tokenizer, text: str = PROMPT) -> torch.Tensor:
    return torch.tensor([tokenizer.eot_id, *tokenizer.encode(text)])


def circuit_tracer_python() -> str | None:
    """A Python that has circuit-tracer: $LLMCLI_CIRCUIT_TRACER_PYTHON, else this one if it has
    it. circuit-tracer 0.5.0 pins transformers <= 4.57.3 and huggingface_hub < 1.0, which llmcli
    excludes, so it usually lives in an environment of its own."""
    named = os.environ.get("LLMCLI_CIRCUIT_TRACER_PYTHON")
    if named:
        return shutil.which(named) or named
    return sys.executable if importlib.util.find_spec("circuit_tracer") else None


CIRCUIT_TRACER_SCRIPT = ROOT / "benchmarks" / "circuit_tracer_graph.py"
