"""Shared by the SAE tests: a small run on a slice of the bundled corpus, an SAE trained on it in
a few steps, and the SAE's formulas written out in NumPy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import save_tiny_run, small_run_config

from llmcli.data.tokenizer import CharTokenizer
from llmcli.inspection.sae.config import SAEConfig
from llmcli.inspection.sae.train import TrainOptions, train_sae

HOOK = "blocks.1.resid_post"


def small_run(folder: Path, corpus: Path, **model) -> Path:
    """A readable 2-layer, 16-wide char run over `corpus` (untrained, sharpened weights)."""
    raw = small_run_config(corpus)
    raw["model"] |= {"n_layer": 2, **model}
    tokenizer = CharTokenizer.train([corpus.read_text(encoding="utf-8")])
    return save_tiny_run(folder, tokenizer, raw, seed=1, sharpen=3.0)


def small_config(**settings) -> SAEConfig:
    """An SAE of 64 features, k 4, trained for 6 steps of 128 activations."""
    values = {"hook": HOOK, "features": 64, "k": 4, "steps": 6, "batch_tokens": 128}
    return SAEConfig(**{**values, "log_interval": 2, "save_interval": 3, **settings})


def trained_sae(run: Path, out: Path, **settings) -> Path:
    options = TrainOptions(checkpoint=run, out=out, device="cpu", threads=1)
    train_sae(small_config(**settings), options)
    return out


def numpy_encode(x: np.ndarray, W_enc, b_enc, b_dec, k: int) -> np.ndarray:
    """TopK: each row's k largest of `(x - b_dec) W_enc + b_enc`, through a ReLU; the rest 0."""
    pre = (x - b_dec) @ W_enc + b_enc  # (N, F)
    acts = np.zeros_like(pre)
    for i, row in enumerate(pre):
        top = np.argsort(row)[-k:]
        acts[i, top] = np.maximum(row[top], 0.0)
    return acts


def numpy_decode(acts: np.ndarray, W_dec, b_dec) -> np.ndarray:
    return acts @ W_dec + b_dec
