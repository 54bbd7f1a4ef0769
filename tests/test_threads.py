"""CPU threads for generation (llmcli/generation/threads.py): which generations are bound by
one-token steps, the thread count they run on, and the `auto` count (llmcli/device.py)."""

from __future__ import annotations

import pytest
import torch

from llmcli.config import ModelConfig, SampleConfig
from llmcli.generation.threads import (
    ONE_THREAD_DECODE_PARAMS,
    decode_bound,
    sampling_threads,
    torch_threads,
)
from llmcli.model.gpt import Transformer


def test_sampling_threads_one_for_a_small_decode_bound_model_only() -> None:
    cpu = torch.device("cpu")
    tiny = Transformer(ModelConfig(n_layer=4, n_head=4, n_embed=128, context_length=64), 65)  # 0.8M
    big = Transformer(
        ModelConfig(n_layer=6, n_head=6, n_embed=384, context_length=256), 65
    )  # 10.7M
    assert tiny.num_parameters(non_embedding=True) <= ONE_THREAD_DECODE_PARAMS
    assert big.num_parameters(non_embedding=True) > ONE_THREAD_DECODE_PARAMS
    assert sampling_threads(tiny, cpu, decode_bound=True) == 1
    assert sampling_threads(tiny, cpu, decode_bound=False) is None  # full windows: torch's own
    assert sampling_threads(big, cpu, decode_bound=True) is None
    assert sampling_threads(tiny, torch.device("cuda"), decode_bound=True) is None


def test_torch_threads_sets_and_restores_the_count() -> None:
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with torch_threads(target):
        assert torch.get_num_threads() == target
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(target):
        raise RuntimeError("restored even so")
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before


def test_decode_bound_generations_are_those_of_one_token_steps() -> None:
    shift, short_exact, long_exact = (
        SampleConfig(max_new_tokens=100),
        SampleConfig(max_new_tokens=10, context_policy="exact"),
        SampleConfig(max_new_tokens=100, context_policy="exact"),
    )
    assert decode_bound(shift, 16) and decode_bound(short_exact, 16)
    assert not decode_bound(long_exact, 16)  # past the context each step recomputes the window
    assert not decode_bound(SampleConfig(max_new_tokens=16, context_policy="exact"), 16)


@pytest.mark.parametrize(
    ("busy_share", "cpus", "expected"),
    [(0.0, 2, 2), (0.5, 2, 1), (1.0, 2, 1), (0.25, 8, 6), (0.9, 8, 1)],
)
def test_auto_threads_are_the_cpus_nothing_else_uses(
    monkeypatch: pytest.MonkeyPatch, busy_share: float, cpus: int, expected: int
) -> None:
    # Two readings of /proc/stat 1,000 jiffies apart, `busy_share` of them busy: "auto" takes
    # the idle share of the CPUs, rounded, at least one.
    import llmcli.device as device

    readings = iter([(10_000, 4_000), (11_000, 4_000 + round(1_000 * (1 - busy_share)))])
    monkeypatch.setattr(device, "_cpu_times", lambda: next(readings))
    monkeypatch.setattr(device.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(device.time, "sleep", lambda s: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert device.resolve_threads("auto") == expected


def test_auto_threads_leave_omp_num_threads_and_unreadable_load_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import llmcli.device as device

    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # torchrun's or the user's choice stands
    assert device.resolve_threads("auto") == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "many")  # not a count: torch's own
    assert device.resolve_threads("auto") is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(device, "_cpu_times", lambda: None)  # no /proc/stat (macOS, Windows)
    assert device.resolve_threads("auto") is None
    assert device.resolve_threads(2) == 2 and device.resolve_threads(None) is None
