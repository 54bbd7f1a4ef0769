"""Where and in what precision the model runs: the device, mixed precision, memory checks.

`resolve_device` turns "auto" / "cpu" / "cuda" / "mps" into a torch device for every command.
`Precision` owns what a training step does differently per precision: the autocast context,
the GradScaler (fp16 only), and the unscale / clip / step / zero sequence; the training loop
and `llmcli bench` both step through it. `check_memory` refuses a model and batch that cannot fit
before anything is allocated. `sampling_threads` picks the CPU thread count for generation and
`torch_threads` applies one for a while.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llmcli.errors import InputError

if TYPE_CHECKING:
    from llmcli.config import Config

DEVICES = ("auto", "cpu", "cuda", "mps")

# Up to this many non-embedding parameters a one-token decode step ran faster on one thread than
# on two (2-core VM, torch 2.13: 4L/128 0.70 vs 0.92 ms, 4L/192 1.56 vs 1.76, 4L/256 2.43 vs
# 2.49; 6L/384, 10.7M, 7.56 vs 6.92): its operations are too small to share.
ONE_THREAD_DECODE_PARAMS = 4_000_000


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


def resolve_precision(device: torch.device, dtype: str) -> tuple[str, torch.dtype | None, bool]:
    """The precision to train in: (name, autocast dtype or None for fp32, use a GradScaler).

    "auto" is fp32 on CPU and MPS; on CUDA, bf16 autocast where the GPU supports it, else fp16
    autocast with a GradScaler. The weights and the optimizer stay fp32 in every case.

    Raises:
        InputError: a precision the device cannot train in.
    """
    if dtype == "auto":
        if device.type == "cuda":
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        else:
            dtype = "float32"
    if dtype == "float32":
        return dtype, None, False
    if device.type == "cuda":
        if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise InputError(
                "train.dtype is 'bfloat16' but this GPU does not support it: use "
                "--set train.dtype=float16 (or auto)."
            )
        return dtype, getattr(torch, dtype), dtype == "float16"
    if device.type == "cpu" and dtype == "bfloat16":
        return dtype, torch.bfloat16, False
    raise InputError(
        f"train.dtype ({dtype!r}) is not supported on {device.type}: use float32 or auto"
        + (" (or bfloat16)" if device.type == "cpu" else "")
        + "."
    )


@dataclass
class Precision:
    """How one training step computes: autocast, loss scaling, clipping and the optimizer step.

    Attributes:
        name: "float32", "bfloat16" or "float16".
        device: where the model runs.
        autocast_dtype: the dtype of autocast regions, None for plain fp32.
        scaler: the fp16 GradScaler, else None.
    """

    name: str
    device: torch.device
    autocast_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler | None

    @classmethod
    def resolve(cls, device: torch.device, dtype: str) -> Precision:
        """The precision `train.dtype` asks for on `device` (see `resolve_precision`)."""
        name, amp_dtype, use_scaler = resolve_precision(device, dtype)
        scaler = torch.amp.GradScaler(device.type) if use_scaler else None
        return cls(name, device, amp_dtype, scaler)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context a forward pass runs in (a no-op for fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (scaled first under fp16)."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[Any],
        grad_clip: float,
        want_norm: bool = False,
    ) -> torch.Tensor | None:
        """Clip the gradients' global norm to `grad_clip` (0: no clipping), step, zero them.

        Returns:
            The global gradient norm before clipping, a 0-d tensor on the device (not read
            back, so no synchronisation): always when clipping (it comes free), else only with
            `want_norm`; otherwise None.
        """
        norm = None
        if grad_clip > 0 or want_norm:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)  # the norm of the true gradients
            if grad_clip > 0:
                norm = nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
            else:
                grads = [p.grad for p in params if p.grad is not None]
                norm = nn.utils.get_total_norm(grads, foreach=True)  # what clipping measures
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


def sampling_threads(model: nn.Module, device: torch.device, decode_bound: bool) -> int | None:
    """The CPU thread count generation runs best on: 1 when its steps are mostly one-token
    decode steps (`decode_bound`) of a small model, else None (keep torch's own choice, which
    full-window forwards and larger models use well)."""
    if device.type != "cpu" or not decode_bound:
        return None
    n_params = model.num_parameters(non_embedding=True)  # type: ignore[operator]
    return 1 if n_params <= ONE_THREAD_DECODE_PARAMS else None


@contextlib.contextmanager
def torch_threads(n: int | None) -> Any:
    """Run the block on `n` CPU threads (None: as it is), then restore the previous count."""
    if n is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def format_count(n: int) -> str:
    """1234 -> "1.2K", 3.4e6 -> "3.4M" (parameter counts in messages)."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:,.1f}{unit}"
    return str(n)


def is_out_of_memory(exc: BaseException) -> bool:
    """True for the errors torch and the allocator raise when memory runs out."""
    text = str(exc)
    return (
        isinstance(exc, (MemoryError, torch.OutOfMemoryError))
        or "can't allocate memory" in text
        or "out of memory" in text
    )


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
