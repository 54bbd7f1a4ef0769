"""Where the model runs: `resolve_device` turns "auto" / "cpu" / "cuda" / "mps" into a torch
device, for every command; `torch_threads` runs a block on a number of CPU threads, and
`check_threads` checks a `--threads` option."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

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


def check_threads(n: int | None, what: str = "--threads") -> int | None:
    """A thread count asked for on the command line, checked against this machine's CPUs.

    Raises:
        InputError: `n` outside 1..the number of CPUs (torch crashes on absurd counts).
    """
    cpus = os.cpu_count() or 1
    if n is not None and not 1 <= n <= cpus:
        raise InputError(f"{what} ({n}) must be in 1..{cpus} (this machine's CPUs).")
    return n


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block on `n` CPU threads (None: as it is), then restore the previous count.

    A count above this machine's CPUs (a config written on a bigger one) is cut to them.
    """
    if n is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, min(n, os.cpu_count() or 1)))
    try:
        yield
    finally:
        torch.set_num_threads(previous)
