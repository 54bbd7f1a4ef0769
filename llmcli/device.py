"""Where the model runs: `resolve_device` turns "auto" / "cpu" / "cuda" / "mps" into a torch
device, for every command."""

from __future__ import annotations

import torch

from llmcli.errors import InputError

DEVICES = ("auto", "cpu", "cuda", "mps")


def _suggest(what: str, value: str) -> str:
    return f"{what} {value}" if what.startswith("--") else f"--set {what}={value}"


def resolve_device(name: str, local_rank: int = 0, *, what: str = "train.device") -> torch.device:
    """A device name as a torch device: "auto" picks CUDA, then MPS, then the CPU.

    Args:
        name: "auto", "cpu", "cuda" or "mps".
        local_rank: this process's GPU under torchrun (cuda only).
        what: how messages name the setting ("train.device", "--device").

    Raises:
        InputError: an unknown name, or CUDA or MPS asked for where there is none.
    """
    mps = getattr(torch.backends, "mps", None)
    mps_ok = bool(mps is not None and mps.is_available())
    if name not in DEVICES:
        raise InputError(f"{what} must be auto, cpu, cuda or mps, not {name!r}.")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if mps_ok else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            cuda = torch.version.cuda
            build = "a CPU-only build" if cuda is None else f"CUDA {cuda}"
            raise InputError(
                f"{what} is 'cuda' but no CUDA device is available (torch "
                f"{torch.__version__}, {build}): use {_suggest(what, 'auto')} or cpu."
            )
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if name == "mps":
        if not mps_ok:
            raise InputError(
                f"{what} is 'mps' but Apple's MPS backend is not available here: use "
                f"{_suggest(what, 'auto')} or cpu."
            )
        return torch.device("mps")
    return torch.device("cpu")
