"""The loop's counters (llmcli/training/counters.py)."""

from __future__ import annotations

import math

from llmcli.training.counters import TrainState


def test_an_evaluation_is_the_best_only_below_the_best_so_far() -> None:
    """A tie keeps the earlier best (and its `best.safetensors`); any lower loss replaces it."""
    state = TrainState(step=10)
    assert state.record_eval({"train": 2.0, "val": 1.5})
    state.step = 20
    assert not state.record_eval({"train": 1.9, "val": 1.5})
    assert (state.best_val_loss, state.best_step) == (1.5, 10)
    assert state.last_eval == {"train": 1.9, "val": 1.5}
    state.step = 30
    assert state.record_eval({"train": 1.8, "val": math.nextafter(1.5, 0.0)})
    assert state.best_step == 30
