"""Devices, precision and memory checks (llmcli/device.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmcli.config import ModelConfig, config_from_dict
from llmcli.device import (
    ONE_THREAD_DECODE_PARAMS,
    Precision,
    check_memory,
    estimate_training_bytes,
    resolve_device,
    resolve_precision,
    sampling_threads,
    torch_threads,
)
from llmcli.errors import InputError
from llmcli.model.gpt import Transformer


def test_device_and_precision_choices() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("cuda").type == "cuda"
        name, amp, scaler = resolve_precision(torch.device("cuda"), "auto")
        assert amp == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
        assert scaler is (amp == torch.float16)
    else:
        assert resolve_device("auto").type in ("cpu", "mps")
        with pytest.raises(InputError, match="no CUDA device"):
            resolve_device("cuda")
    assert resolve_precision(torch.device("cpu"), "auto") == ("float32", None, False)
    assert resolve_precision(torch.device("cpu"), "bfloat16") == ("bfloat16", torch.bfloat16, False)
    with pytest.raises(InputError, match="float16"):
        resolve_precision(torch.device("cpu"), "float16")


@pytest.mark.parametrize(
    "model",
    [
        {},
        {"tie_embeddings": False},
        {"pos_emb": "rope"},
        {"n_layer": 3, "n_embed": 48, "n_head": 4},
    ],
)
def test_memory_estimate_counts_the_parameters_and_refuses_what_cannot_fit(model: dict) -> None:
    from llmcli.model.gpt import Transformer

    model_cfg = {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 8}
    config = config_from_dict({"model": model_cfg, "train": {"batch_size": 4}}, name="t")
    for key, value in model.items():
        setattr(config.model, key, value)
    n_params, need = estimate_training_bytes(config, 50)
    assert n_params == Transformer(config.model, 50).num_parameters()
    assert need > 16 * n_params
    check_memory(config, 50, torch.device("cpu"))  # fits
    config.model.n_embed, config.model.n_head = 4_000_000_000, 1
    with pytest.raises(InputError, match=r"needs about [\d,.]+ GiB .* lower model.n_embed"):
        check_memory(config, 50, torch.device("cpu"))


def test_device_names_are_checked_and_messages_name_the_setting() -> None:
    with pytest.raises(InputError, match=r"--device must be auto, cpu, cuda or mps, not 'tpu'"):
        resolve_device("tpu", what="--device")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match=r"use --device auto or cpu"):
            resolve_device("cuda", what="--device")
        with pytest.raises(InputError, match=r"use --set train.device=auto or cpu"):
            resolve_device("cuda")


def make_model_and_batch(seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model, torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_fp32_step_equals_the_plain_backward_clip_step(clip: float) -> None:
    ours, x, y = make_model_and_batch(0)
    ref, _, _ = make_model_and_batch(0)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    precision = Precision.resolve(torch.device("cpu"), "auto")
    assert (precision.name, precision.autocast_dtype, precision.scaler) == ("float32", None, None)
    with precision.autocast():
        loss = nn.functional.mse_loss(ours(x), y)
    precision.backward(loss)
    norm = precision.step(opt, list(ours.parameters()), clip, want_norm=True)

    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
    torch.testing.assert_close(norm, ref_norm)  # the norm before clipping, either way
    if clip > 0:
        assert ref_norm > clip  # the clipping path is taken
        for p in ref.parameters():
            p.grad.mul_(clip / (ref_norm + 1e-6))
    ref_opt.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert a.grad is None  # zeroed (set to None) after the step


def test_no_norm_is_computed_unless_clipping_or_asked() -> None:
    model, x, y = make_model_and_batch(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = Precision.resolve(torch.device("cpu"), "float32")
    nn.functional.mse_loss(model(x), y).backward()
    assert precision.step(opt, list(model.parameters()), 0.0) is None


def test_bf16_autocast_on_cpu_runs_matmuls_in_bf16() -> None:
    precision = Precision.resolve(torch.device("cpu"), "bfloat16")
    with precision.autocast():
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16 and precision.scaler is None


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
