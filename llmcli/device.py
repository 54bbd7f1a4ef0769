"""Where the model runs: `resolve_device` turns "auto" / "cpu" / "cuda" / "mps" into a torch
device, for every command; `torch_threads` runs a block on a number of CPU threads, and
`check_threads` checks a `--threads` option; `timed` measures work on a device."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

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


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on a GPU (on the CPU, work is done when its call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds `fn` takes on `device`, its queued GPU work included (and none from before)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def check_threads(n: int | None, what: str = "--threads") -> int | None:
    """A thread count asked for on the command line, checked against this machine's CPUs.

    Raises:
        InputError: `n` outside 1..the number of CPUs (torch crashes on absurd counts).
    """
    cpus = os.cpu_count() or 1
    if n is not None and not 1 <= n <= cpus:
        raise InputError(f"{what} ({n}) must be in 1..{cpus} (this machine's CPUs).")
    return n


def free_cpus(window_s: float = 0.05) -> int | None:
    """How many CPUs nothing else is using: the idle share of all CPUs over `window_s` seconds
    (/proc/stat, Linux), rounded, at least 1; None where that cannot be read.

    The caller sleeps through the window, so its own work does not count as busy.
    """
    first = _cpu_times()
    if first is None:
        return None
    time.sleep(window_s)
    second = _cpu_times()
    if second is None:
        return None
    total, idle = second[0] - first[0], second[1] - first[1]
    cpus = os.cpu_count() or 1
    return max(1, round(cpus * idle / total)) if total > 0 else cpus


def _cpu_times() -> tuple[int, int] | None:
    """(all jiffies, idle jiffies) of every CPU together, from /proc/stat's first line."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 4:
        return None
    return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait


def resolve_threads(n: int | str | None) -> int | None:
    """The CPU threads `train.threads` asks for: a number as it is; "auto": OMP_NUM_THREADS where
    it is set (torchrun's or the user's choice), else as many as the CPUs nothing else is using
    (`free_cpus`; None, torch's own count, where the load cannot be read); None: torch's count."""
    if n != "auto":
        return n if isinstance(n, int) else None
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp:
        return int(omp) if omp.isdigit() and int(omp) > 0 else None
    return free_cpus()


@contextlib.contextmanager
def torch_threads(n: int | str | None) -> Iterator[None]:
    """Run the block on `n` CPU threads (`resolve_threads`: a number, "auto" or None, which leaves
    the count as it is), then restore the previous count.

    A count above this machine's CPUs (a config written on a bigger one) is cut to them.
    """
    n = resolve_threads(n)
    if n is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, min(n, os.cpu_count() or 1)))
    try:
        yield
    finally:
        torch.set_num_threads(previous)
