"""Running under `torchrun`: this process's rank, the process group, and agreeing across ranks.

`torchrun --nproc_per_node=N -m llmcli train CONFIG` starts N processes with RANK, LOCAL_RANK
and WORLD_SIZE set; alone, a process is rank 0 of 1 and every helper here is a no-op. Ranks
must take part in the same collectives in the same order, so a rank that fails during set-up
says so through `agreed` instead of leaving the others waiting forever.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from llmcli.errors import InputError


@dataclass
class DistInfo:
    """This process's place in a torchrun job (rank 0 of 1 when run alone)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def dist_from_env(env: dict[str, str] | None = None) -> DistInfo:
    """Read RANK, LOCAL_RANK and WORLD_SIZE (set by torchrun); absent means a single process."""
    env = dict(os.environ) if env is None else env
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise InputError(
            "RANK, LOCAL_RANK and WORLD_SIZE must be integers (torchrun sets them): got "
            f"{env.get('RANK')!r}, {env.get('LOCAL_RANK')!r}, {env.get('WORLD_SIZE')!r}."
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise InputError(f"RANK ({rank}) must be in 0..WORLD_SIZE-1 (WORLD_SIZE={world}).")
    return DistInfo(rank=rank, local_rank=local, world_size=world)


@contextlib.contextmanager
def process_group(info: DistInfo, device: torch.device) -> Iterator[None]:
    """Join the job's process group (nccl on CUDA, gloo on the CPU) for the block, if any."""
    if not info.enabled or dist.is_initialized():
        yield
        return
    if device.type == "mps":
        raise InputError("distributed training needs CUDA or the CPU, not MPS.")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=info.rank, world_size=info.world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def all_ok(ok: bool, info: DistInfo, device: torch.device) -> bool:
    """True when every rank is ok (a collective: every rank must call it)."""
    if not info.enabled:
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag)
    return flag.item() == 0.0


@contextlib.contextmanager
def agreed(info: DistInfo, device: torch.device) -> Iterator[None]:
    """Run a block that may raise InputError on some ranks; then make every rank agree.

    A rank whose block failed raises its error; the others raise one that points at it, instead
    of waiting forever for a collective the failed rank never joins.
    """
    error: InputError | None = None
    try:
        yield
    except InputError as exc:
        error = exc
    if not all_ok(error is None, info, device):
        raise error or InputError("another rank failed during set-up; see its error message.")


def gather(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's `obj`, in rank order (a collective under DDP; `[obj]` alone)."""
    if not info.enabled:
        return [obj]
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def mean_over_ranks(values: torch.Tensor, info: DistInfo) -> None:
    """Average `values` over the ranks, in place (a collective under DDP)."""
    if info.enabled:
        dist.all_reduce(values)
        values /= info.world_size
