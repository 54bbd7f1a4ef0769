"""Choosing the device (llmcli/device.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from llmcli.device import resolve_device
from llmcli.errors import InputError


def test_device_choices() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("cuda").type == "cuda"
    else:
        assert resolve_device("auto").type in ("cpu", "mps")
        with pytest.raises(InputError, match="no CUDA device"):
            resolve_device("cuda")


def test_device_names_are_checked_and_messages_name_the_setting() -> None:
    with pytest.raises(InputError, match=r"--device must be auto, cpu, cuda or mps, not 'tpu'"):
        resolve_device("tpu", what="--device")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match=r"use --device auto or cpu"):
            resolve_device("cuda", what="--device")
        with pytest.raises(InputError, match=r"use --set train.device=auto or cpu"):
            resolve_device("cuda")


@pytest.fixture()
def availability(monkeypatch):
    """Set which accelerators torch reports, without having them: `availability(cuda, mps)`."""

    def set_available(cuda: bool, mps: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)

    return set_available


@pytest.mark.parametrize(
    ("cuda", "mps", "chosen"),
    [(True, True, "cuda"), (True, False, "cuda"), (False, True, "mps"), (False, False, "cpu")],
)
def test_auto_picks_cuda_then_mps_then_the_cpu(availability, cuda, mps, chosen) -> None:
    availability(cuda, mps)
    assert resolve_device("auto").type == chosen
    assert resolve_device("cpu").type == "cpu"  # asked for, whatever else there is


def test_mps_asked_for_where_there_is_none_names_the_setting(availability) -> None:
    availability(False, False)
    with pytest.raises(InputError, match=r"'mps' but Apple's MPS backend is not available here"):
        resolve_device("mps")
    availability(False, True)
    assert resolve_device("mps") == torch.device("mps")


@pytest.mark.parametrize(("platform", "expected"), [("darwin", "1"), ("linux", None)])
def test_the_cli_lets_operations_mps_lacks_fall_back_to_the_cpu(
    monkeypatch, platform, expected
) -> None:
    from llmcli.cli import main

    monkeypatch.setenv("PYTORCH_ENABLE_MPS_FALLBACK", "x")  # restored after the test
    monkeypatch.delenv("PYTORCH_ENABLE_MPS_FALLBACK")
    monkeypatch.setattr(sys, "platform", platform)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ.get("PYTORCH_ENABLE_MPS_FALLBACK") == expected
    monkeypatch.setenv("PYTORCH_ENABLE_MPS_FALLBACK", "0")  # the user's own choice wins
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ["PYTORCH_ENABLE_MPS_FALLBACK"] == "0"
