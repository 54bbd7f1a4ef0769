"""Memory: refuse a model and batch that cannot fit, and explain running out of memory.

`check_memory` compares an estimate of what one training step needs (`estimate_training_bytes`)
with the device's memory (`device_memory_bytes`) before anything is allocated;
`out_of_memory_is_bad_input` turns an out-of-memory error during training into a message that
says what to lower.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmcli.errors import InputError
from llmcli.progress import format_count

if TYPE_CHECKING:
    from llmcli.config import Config


def estimate_training_bytes(config: Config, vocab_size: int) -> tuple[int, int]:
    """An estimate of the memory one training step needs: (parameters, bytes).

    Weights, gradients and two AdamW moments (16 bytes per fp32 parameter), plus fp32
    activations kept for the backward pass, about `B T (L (18 C + 3 nh T) + 3 V)` floats
    (after Korthikanti et al., 2022). Used only to refuse what cannot fit before allocating it.
    """
    m, tc = config.model, config.train
    C, L, T, nh = m.n_embed, m.n_layer, m.context_length, m.n_head
    n_params = (
        L * (12 * C * C + 13 * C)
        + vocab_size * C * (1 if m.tie_embeddings else 2)
        + (T * C if m.pos_emb == "learned" else 0)
        + 2 * C
    )
    activations = tc.batch_size * T * (L * (18 * C + 3 * nh * T) + 3 * vocab_size)
    return n_params, 16 * n_params + 4 * activations


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of the device (for the CPU: RAM, within a cgroup limit); None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type != "cpu":
        return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def check_memory(config: Config, vocab_size: int, device: torch.device) -> None:
    """Refuse a model and batch that cannot fit in the device's memory, before allocating.

    Raises:
        InputError: the estimate exceeds the device's total memory.
    """
    n_params, need = estimate_training_bytes(config, vocab_size)
    have = device_memory_bytes(device)
    if have is None or need <= have:
        return
    gib = 2**30
    raise InputError(
        f"training this model needs about {need / gib:,.1f} GiB ({format_count(n_params)} "
        f"parameters, batches of {config.train.batch_size} x {config.model.context_length} "
        f"tokens) but the {device.type} has {have / gib:,.1f} GiB: lower model.n_embed, "
        "model.n_layer or train.batch_size (raise train.grad_accum to keep the tokens per step)."
    )


def is_out_of_memory(exc: BaseException) -> bool:
    """True for the errors torch and the allocator raise when memory runs out."""
    text = str(exc)
    return (
        isinstance(exc, (MemoryError, torch.OutOfMemoryError))
        or "can't allocate memory" in text
        or "out of memory" in text
    )


@contextlib.contextmanager
def out_of_memory_is_bad_input(device: torch.device, run_dir: Path) -> Iterator[None]:
    """Turn running out of memory into a message that says what to lower."""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(exc):
            raise
        raise InputError(
            f"out of memory on {device} ({str(exc).strip().splitlines()[0][:200]}): lower "
            "train.batch_size (raise train.grad_accum to keep the tokens per step), the model "
            f"size or model.context_length. Any checkpoint saved in '{run_dir}' is intact."
        ) from None
