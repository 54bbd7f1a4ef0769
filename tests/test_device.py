"""Choosing the device (llmcli/device.py)."""

from __future__ import annotations

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
