"""Where the model runs: `resolve_device` turns "auto" / "cpu" / "cuda" / "mps" into a torch
device, for every command; `torch_threads` runs a block on a number of CPU threads, and
`check_threads` checks a `--threads` option, both within `usable_cpus`; `timed` measures work
on a device."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

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


def usable_cpus() -> int:
    """The CPUs this process may use: the fewest of the machine's, those its affinity allows
    (`taskset`, Linux) and those its cgroup's CPU quota pays for (`cgroup_cpu_quota`), at least
    1. A container or a pinned process sees every CPU of the host in `os.cpu_count()`; threads
    beyond its share only wait for each other."""
    counts = [os.cpu_count() or 1]
    if hasattr(os, "sched_getaffinity"):
        counts.append(len(os.sched_getaffinity(0)))
    quota = cgroup_cpu_quota()
    if quota is not None:
        counts.append(quota)
    return max(1, min(counts))


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPUs a cgroup's quota pays for, `ceil(quota / period)`, as the cgroup sees its own
    files under `root`: cgroup v2's `cpu.max` ("quota period", or "max period" for no limit),
    else v1's `cpu/cpu.cfs_quota_us` (-1 for no limit) and `cpu/cpu.cfs_period_us`. None where
    there is no limit or the files cannot be read."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if not (quota.isdigit() and period.isdigit()) or int(quota) == 0 or int(period) == 0:
        return None  # "max", "-1" or a file that is not a quota
    return math.ceil(int(quota) / int(period))


def check_threads(n: int | None, what: str = "--threads") -> int | None:
    """A thread count asked for on the command line, checked against the CPUs this process may
    use (`usable_cpus`).

    Raises:
        InputError: `n` outside 1..the number of CPUs (torch crashes on absurd counts).
    """
    if n is None:
        return n
    cpus = usable_cpus()
    if not 1 <= n <= cpus:
        raise InputError(f"{what} ({n}) must be in 1..{cpus} (the CPUs this process may use).")
    return n


def free_cpus(window_s: float = 0.05) -> int | None:
    """How many CPUs nothing else is using: the idle share of all CPUs over `window_s` seconds
    (/proc/stat, Linux), rounded, at least 1 and at most `usable_cpus`; None where that cannot
    be read.

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
    cpus = os.cpu_count() or 1  # /proc/stat's first line sums every CPU of the machine
    free = max(1, round(cpus * idle / total)) if total > 0 else cpus
    return min(free, usable_cpus())


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
    it is set (torchrun's or the user's choice), else as many of the CPUs this process may use
    as nothing else is using (`free_cpus`; None, torch's own count, where the load cannot be
    read); None: torch's count."""
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

    A count above the CPUs this process may use (a config written on a bigger machine) is cut
    to them (`usable_cpus`).
    """
    n = resolve_threads(n)
    if n is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, min(n, usable_cpus())))
    try:
        yield
    finally:
        torch.set_num_threads(previous)
