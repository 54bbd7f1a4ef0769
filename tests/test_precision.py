"""Training precision: autocast, loss scaling, clip and step (llmcli/training/precision.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmcli.errors import InputError
from llmcli.training.precision import Precision, resolve_precision


def test_precision_choices() -> None:
    if torch.cuda.is_available():
        name, amp, scaler = resolve_precision(torch.device("cuda"), "auto")
        assert amp == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
        assert scaler is (amp == torch.float16)
    assert resolve_precision(torch.device("cpu"), "auto") == ("float32", None, False)
    assert resolve_precision(torch.device("cpu"), "bfloat16") == ("bfloat16", torch.bfloat16, False)
    with pytest.raises(InputError, match="float16"):
        resolve_precision(torch.device("cpu"), "float16")


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


@pytest.fixture()
def mps_here(monkeypatch):
    """An MPS device as torch would report one: `mps_here(macos_14=...)`."""

    def set_macos(macos_14: bool) -> None:
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
        monkeypatch.setattr(torch.amp, "is_autocast_available", lambda device: device == "mps")
        monkeypatch.setattr(
            torch.backends.mps, "is_macos_or_newer", lambda major, minor: macos_14 or major < 14
        )

    return set_macos


def test_mps_trains_in_fp32_by_default_and_in_bf16_autocast_where_supported(mps_here) -> None:
    mps = torch.device("mps")
    mps_here(macos_14=True)
    assert resolve_precision(mps, "auto") == ("float32", None, False)
    assert resolve_precision(mps, "float32") == ("float32", None, False)
    assert resolve_precision(mps, "bfloat16") == ("bfloat16", torch.bfloat16, False)
    precision = Precision.resolve(mps, "bfloat16")
    assert precision.scaler is None
    autocast = precision.autocast()  # not entered: there is no MPS device here
    assert (autocast.device, autocast.fast_dtype) == ("mps", torch.bfloat16)
    with pytest.raises(InputError, match=r"'float16'.*not supported on mps.*or bfloat16 on macOS"):
        resolve_precision(mps, "float16")
    mps_here(macos_14=False)
    assert resolve_precision(mps, "auto") == ("float32", None, False)
    with pytest.raises(InputError, match=r"'bfloat16'.*on mps.*needs macOS 14 or newer"):
        resolve_precision(mps, "bfloat16")
