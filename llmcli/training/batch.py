"""The micro-batch and gradient accumulation: `train.batch_size: auto`, `train.tokens_per_step`,
and a smaller micro-batch when the first steps run out of memory.

An optimizer step is `grad_accum` micro-batches of `batch_size` sequences on each of the DDP
ranks. With `train.tokens_per_step`, the step's sequences are fixed
(`tokens_per_step / (context_length x ranks)`) and the micro-batch divides them: a given
`batch_size` sets `grad_accum`; `auto` takes the largest micro-batch whose estimated peak
(`llmcli.training.memory.estimate_memory`) stays within `AUTO_HEADROOM` of the memory
(`train.memory_limit`, else the device's free memory). A resumed run keeps the numbers its save
recorded, whatever the memory free today, so that it goes on exactly.

The estimate is within about 25% of what a step takes; should a fresh run with an automatic
micro-batch still run out of memory in its first `OOM_RETRY_STEPS` steps (on CUDA, where running
out is an exception and not the kernel's OOM killer), `smaller_micro_batch` gives the next size
down and the loop goes on with it, the tokens per step unchanged (`shrink_micro_batch`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch

from llmcli.config import Config
from llmcli.config.rules import divisors
from llmcli.errors import InputError
from llmcli.progress import format_bytes
from llmcli.training.memory import device_free_bytes, estimate_memory
from llmcli.training.step import Trainer

logger = logging.getLogger(__name__)

# An automatic micro-batch's estimated peak stays within this share of the memory: the rest is
# left for the estimate's error and for what else runs on the machine.
AUTO_HEADROOM = 0.8
# Running out of memory within this many steps of a fresh start shrinks an automatic
# micro-batch; later, it is an error (something else took the memory).
OOM_RETRY_STEPS = 10


def resolve_batch(
    config: Config,
    vocab_size: int,
    device: torch.device,
    dtype: str,
    world_size: int = 1,
    saved: dict[str, Any] | None = None,
) -> Config:
    """The config with the micro-batch and accumulation a run trains with, as numbers.

    Args:
        config: a validated config.
        vocab_size: the tokenizer's vocabulary.
        device: where the run trains.
        dtype: the precision it computes in (`Precision.name`).
        world_size: DDP processes.
        saved: the config a resumed run was saved with (`ResumeState.config`): its numbers are
            kept for `batch_size: auto`.

    Raises:
        InputError: `tokens_per_step` that the ranks or the micro-batch do not divide, or a
            memory too small for one sequence (naming the smallest limit that works).
    """
    tc = config.train
    if tc.tokens_per_step is None:
        return config
    n_seqs = step_sequences(config, world_size)
    if tc.batch_size != "auto":
        return _with_batch(config, tc.batch_size, _accumulation(config, tc.batch_size, n_seqs))
    saved_train = (saved or {}).get("train", {})
    if isinstance(saved_train.get("batch_size"), int):
        batch, accum = saved_train["batch_size"], saved_train.get("grad_accum", 1)
        logger.info(
            "train.batch_size auto: resuming with the run's %d sequences x grad_accum %d",
            batch,
            accum,
        )
        return _with_batch(config, batch, accum)
    batch = choose_micro_batch(config, vocab_size, device, dtype, world_size)
    logger.info(
        "train.batch_size auto: %d sequences per micro-batch x grad_accum %d = %d tokens per step",
        batch,
        n_seqs // batch,
        tc.tokens_per_step,
    )
    return _with_batch(config, batch, n_seqs // batch)


def step_sequences(config: Config, world_size: int = 1) -> int:
    """The sequences (DPO: pairs) each rank trains on per optimizer step, from
    `train.tokens_per_step`.

    Raises:
        InputError: the tokens do not split into whole sequences on every rank.
    """
    tokens, T = config.train.tokens_per_step, config.example_tokens
    assert tokens is not None
    per_seq = T * world_size
    if tokens % per_seq:
        raise InputError(
            f"train.tokens_per_step ({tokens}) must be a multiple of the {T} tokens of an "
            f"example x the {world_size} processes ({per_seq}), so that every rank trains on "
            f"whole ones: for example {max(1, tokens // per_seq) * per_seq}."
        )
    return tokens // (T * world_size)


def choose_micro_batch(
    config: Config, vocab_size: int, device: torch.device, dtype: str, world_size: int = 1
) -> int:
    """The largest micro-batch that divides the step's sequences and whose estimated peak is
    within `AUTO_HEADROOM` of the memory (`train.memory_limit`, else the device's free memory).

    Raises:
        InputError: the memory is unknown, or too small for a micro-batch of one sequence.
    """
    n_seqs = step_sequences(config, world_size)
    limit = config.train.memory_limit_bytes
    budget = limit if limit is not None else device_free_bytes(device)
    if budget is None:
        raise InputError(
            f"train.batch_size auto needs to know the memory, and the free memory of "
            f"{device.type} is unknown: set train.memory_limit (for example "
            "--set train.memory_limit=8GB)."
        )
    one = estimate_memory(config, vocab_size, device.type, dtype, world_size, batch_size=1)
    fixed, per_sequence = one.peak - one.activations, one.activations
    largest = math.floor((AUTO_HEADROOM * budget - fixed) / per_sequence)
    if largest < 1:
        smallest = math.ceil(one.peak / AUTO_HEADROOM)
        where = (
            f"train.memory_limit ({config.train.memory_limit})"
            if limit is not None
            else f"the {device.type}'s free memory"
        )
        raise InputError(
            f"{where} is {format_bytes(budget)}, too little for this model: one sequence per "
            f"micro-batch needs about {format_bytes(one.peak)} (weights "
            f"{format_bytes(one.weights)}, gradients {format_bytes(one.grads)}, optimizer "
            f"{format_bytes(one.optimizer)}, activations {format_bytes(one.activations)}, "
            f"runtime {format_bytes(one.runtime)}), plus {1 - AUTO_HEADROOM:.0%} headroom. The "
            f"smallest limit that works is {smallest} bytes "
            f"(--set train.memory_limit={_round_up_mib(smallest)}MiB); or make the model smaller."
        )
    return max(d for d in divisors(n_seqs) if d <= largest)


def smaller_micro_batch(config: Config) -> int | None:
    """After running out of memory: the largest micro-batch at most half the current one that
    divides the sequences per step (exactly half when it divides them), or None at one."""
    tc = config.train
    assert isinstance(tc.batch_size, int)
    smaller = [d for d in divisors(tc.batch_size * tc.grad_accum) if d <= tc.batch_size // 2]
    return max(smaller, default=None)


def may_shrink(config: Config, step: int) -> bool:
    """Whether running out of memory in 0-based step `step` of a run that can shrink its
    micro-batch does so: in the first `OOM_RETRY_STEPS` steps, not yet down to one sequence."""
    return step < OOM_RETRY_STEPS and smaller_micro_batch(config) is not None


def shrink_micro_batch(config: Config, trainer: Trainer, step: int, tokens_per_step: int) -> Config:
    """Go on with a smaller micro-batch (`smaller_micro_batch`) and more accumulation, the
    tokens per step unchanged: drop the failed step's gradients, tell the trainer and its
    sampler, and say so in one line. Returns the config with the new numbers (to record).
    """
    old = config.train.batch_size
    batch = smaller_micro_batch(config)
    assert batch is not None
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.precision.forget_step()  # fp16: the failed step may have unscaled its gradients
    if trainer.precision.device.type == "cuda":
        torch.cuda.empty_cache()  # give the failed step's blocks back before the smaller one
    config = with_micro_batch(config, batch)
    trainer.batches.batch_size = batch
    trainer.grad_accum = config.train.grad_accum
    logger.warning(
        "note: out of memory at step %d with %d sequences per micro-batch: going on with %d "
        "x grad_accum %d (the same %d tokens per step)",
        step + 1,
        old,
        batch,
        config.train.grad_accum,
        tokens_per_step,
    )
    return config


def _accumulation(config: Config, batch: int, n_seqs: int) -> int:
    """`grad_accum` for a given micro-batch under `train.tokens_per_step`.

    Raises:
        InputError: the micro-batch does not divide the step, or `grad_accum` says otherwise.
    """
    tc = config.train
    if n_seqs % batch:
        raise InputError(
            f"train.tokens_per_step ({tc.tokens_per_step}) is {n_seqs} sequences per process, "
            f"which train.batch_size ({batch}) does not divide: pick batch_size among "
            f"{divisors(n_seqs)[-8:]}, or train.batch_size: auto."
        )
    accum = n_seqs // batch
    if tc.grad_accum not in (1, accum):
        raise InputError(
            f"train.grad_accum ({tc.grad_accum}) disagrees with train.tokens_per_step "
            f"({tc.tokens_per_step}), which with train.batch_size {batch} means grad_accum "
            f"{accum}: give one of them."
        )
    return accum


def with_micro_batch(config: Config, batch: int) -> Config:
    """The config with micro-batch `batch`, and the grad_accum that keeps its sequences per step
    (`batch` must divide them)."""
    tc = config.train
    assert isinstance(tc.batch_size, int)
    n_seqs = tc.batch_size * tc.grad_accum
    assert n_seqs % batch == 0, (n_seqs, batch)
    return _with_batch(config, batch, n_seqs // batch)


def _with_batch(config: Config, batch: int, accum: int) -> Config:
    train = dataclasses.replace(config.train, batch_size=batch, grad_accum=accum)
    return dataclasses.replace(config, train=train)


def _round_up_mib(n: int) -> int:
    return -(-n // 2**20)
