"""Every RNG state a training process uses (llmcli/training/rng.py): saved and restored."""

from __future__ import annotations

import torch

from llmcli.training.rng import rng_state, set_rng_state


def test_the_rng_state_on_mps_holds_and_restores_the_mps_generator(monkeypatch) -> None:
    generator = {"state": torch.arange(8, dtype=torch.uint8)}  # an MPS generator, mocked
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: generator["state"].clone())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda s: generator.update(state=s.clone()))
    saved = rng_state(torch.device("mps"))
    assert torch.equal(saved["mps"], torch.arange(8, dtype=torch.uint8))
    assert "mps" not in rng_state(torch.device("cpu"))
    generator["state"] = torch.zeros(8, dtype=torch.uint8)
    set_rng_state(saved, torch.device("mps"))
    assert torch.equal(generator["state"], torch.arange(8, dtype=torch.uint8))
