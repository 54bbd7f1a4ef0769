"""CPU threads for generation (llmcli/generation/threads.py)."""

from __future__ import annotations

import pytest
import torch

from llmcli.config import ModelConfig
from llmcli.generation.threads import ONE_THREAD_DECODE_PARAMS, sampling_threads, torch_threads
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


def test_decode_bound_generations_get_the_small_gelu_kernel_and_others_torchs() -> None:
    from llmcli.config import SampleConfig
    from llmcli.generation.sample import decode_kernels
    from llmcli.generation.threads import decode_bound

    shift, short_exact, long_exact = (
        SampleConfig(max_new_tokens=100),
        SampleConfig(max_new_tokens=10, context_policy="exact"),
        SampleConfig(max_new_tokens=100, context_policy="exact"),
    )
    assert decode_bound(shift, 16) and decode_bound(short_exact, 16)
    assert not decode_bound(long_exact, 16)  # past the context each step recomputes the window
    model = Transformer(ModelConfig(n_layer=1, n_head=2, n_embed=16, context_length=16), 11)
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = True
    try:
        for config, aten in ((shift, True), (short_exact, True), (long_exact, False)):
            with decode_kernels(model, config, 1):
                assert torch.backends.mkldnn.enabled is not aten
            assert torch.backends.mkldnn.enabled
    finally:
        torch.backends.mkldnn.enabled = before
