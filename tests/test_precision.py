"""Training precision: the choices, autocast and loss scaling (llmcli/training/precision.py)."""

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


def test_only_fp16_scales_the_loss() -> None:
    precision = Precision.resolve(torch.device("cpu"), "auto")
    assert (precision.name, precision.autocast_dtype) == ("float32", None)
    assert not precision.scales_loss and not precision.scaler.is_enabled()
    loss = torch.tensor(2.5)
    assert precision.scaler.scale(loss) is loss  # a disabled scaler passes everything through


def test_bf16_autocast_on_cpu_runs_matmuls_in_bf16() -> None:
    precision = Precision.resolve(torch.device("cpu"), "bfloat16")
    with precision.autocast():
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16 and not precision.scales_loss


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
    assert not precision.scales_loss
    autocast = precision.autocast()  # not entered: there is no MPS device here
    assert (autocast.device, autocast.fast_dtype) == ("mps", torch.bfloat16)
    with pytest.raises(InputError, match=r"'float16'.*not supported on mps.*or bfloat16 on macOS"):
        resolve_precision(mps, "float16")
    mps_here(macos_14=False)
    assert resolve_precision(mps, "auto") == ("float32", None, False)
    with pytest.raises(InputError, match=r"'bfloat16'.*on mps.*needs macOS 14 or newer"):
        resolve_precision(mps, "bfloat16")
