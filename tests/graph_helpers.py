"""Shared by the graph tests: a small run with transcoders on every layer, and the prompt's ids."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
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
    """A Python that imports circuit-tracer: $LLMCLI_CIRCUIT_TRACER_PYTHON, else this one if it
    can. circuit-tracer 0.5.0 pins transformers <= 4.57.3 and huggingface_hub < 1.0, which llmcli
    excludes, so it usually lives in an environment of its own."""
    named = os.environ.get("LLMCLI_CIRCUIT_TRACER_PYTHON")
    python = (shutil.which(named) or named) if named else sys.executable
    if not named and importlib.util.find_spec("circuit_tracer") is None:
        return None
    check = [python, "-c", "import circuit_tracer.attribution.attribute"]
    try:  # installed beside llmcli's pins it may fail to import: that counts as absent
        subprocess.run(check, check=True, capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError):
        return None
    return python


CIRCUIT_TRACER_SCRIPT = ROOT / "benchmarks" / "circuit_tracer_graph.py"
