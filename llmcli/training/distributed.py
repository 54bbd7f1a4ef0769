"""Running under `torchrun`: this process's rank, the process group, and agreeing across ranks.

`torchrun --nproc_per_node=N -m llmcli train CONFIG` starts N processes with RANK, LOCAL_RANK
and WORLD_SIZE set; alone, a process is rank 0 of 1 and every helper here is a no-op. Ranks
must take part in the same collectives in the same order, so a rank that fails during set-up
says so through `agreed` instead of leaving the others waiting forever.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from llmcli.errors import InputError

logger = logging.getLogger(__name__)

# Joining the group waits for every rank, then connects them, and gloo's connection can wait for
# a peer forever (its own timeout does not apply there; seen after restarts, see _attempt_store):
# a process still joining after this many seconds exits with status 1, so that torchrun restarts
# the group once more.
JOIN_TIMEOUT_ENV, JOIN_TIMEOUT_S = "LLMCLI_DIST_JOIN_TIMEOUT", 300.0


def join_timeout() -> float:
    """Seconds a rank may take to join its group: $LLMCLI_DIST_JOIN_TIMEOUT, else 300.

    Raises:
        InputError: the variable is not a positive number.
    """
    text = os.environ.get(JOIN_TIMEOUT_ENV)
    if text is None:
        return JOIN_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise InputError(f"{JOIN_TIMEOUT_ENV}={text!r}: give a positive number of seconds.")
    return seconds


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
    """Join the job's process group (nccl on CUDA, gloo on the CPU) for the block, if any.

    Raises:
        InputError: a bad $LLMCLI_DIST_JOIN_TIMEOUT, in a 1-process run too (a typo shows up
            before a torchrun job meets it), or distributed training on MPS.
    """
    timeout = join_timeout()
    if not info.enabled or dist.is_initialized():
        yield
        return
    if device.type == "mps":
        raise InputError("distributed training needs CUDA or the CPU, not MPS.")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    with _exit_if_stuck(timeout, info):
        dist.init_process_group(
            backend, store=_attempt_store(info), rank=info.rank, world_size=info.world_size
        )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _attempt_store(info: DistInfo) -> dist.Store | None:
    """On one machine under torchrun, the agent's store seen through a prefix of this attempt.

    After a restart, torchrun's single-node agent keeps its store, and the keys where gloo's ranks
    leave their addresses still hold the previous attempt's: a rank that reads one before its peer
    rewrites it connects to a dead process, then fails or waits forever. A prefix per restart
    (every rank of one agent has the same restart count) gives each attempt its own keys. Across
    machines the agents' counts can differ, and torch's default store is used (None).
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("GROUP_WORLD_SIZE") != "1":
        return None
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), info.world_size, is_master=False
    )
    attempt = f"llmcli/{env.get('TORCHELASTIC_RUN_ID', '')}/{env['TORCHELASTIC_RESTART_COUNT']}"
    return dist.PrefixStore(attempt, store)


@contextlib.contextmanager
def _exit_if_stuck(seconds: float, info: DistInfo) -> Iterator[None]:
    """Exit the process (status 1) if the block has not finished after `seconds`."""

    def stuck() -> None:
        logger.error(
            "rank %d could not join the other %d ranks within %.0f s; exiting so that torchrun "
            "(--max-restarts) starts the group again",
            info.rank,
            info.world_size - 1,
            seconds,
        )
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, stuck)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


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


def sum_over_ranks(values: torch.Tensor) -> None:
    """Sum `values` over the ranks, in place (what an objective's step is handed to normalise
    by every rank's tokens, `llmcli.objectives.base.SumRanks`)."""
    dist.all_reduce(values)
