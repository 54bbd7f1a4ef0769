"""The precision a training step computes in: autocast, loss scaling, clipping and the step.

`resolve_precision` turns `train.dtype` into what a device can train in; `Precision` owns what a
training step does differently per precision: the autocast context, the GradScaler (fp16 only),
and the unscale / clip / step / zero sequence. The training loop, `llmcli eval` and
`llmcli bench` all step or evaluate through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmcli.errors import InputError


def resolve_precision(device: torch.device, dtype: str) -> tuple[str, torch.dtype | None, bool]:
    """The precision to train in: (name, autocast dtype or None for fp32, use a GradScaler).

    "auto" is fp32 on CPU and MPS; on CUDA, bf16 autocast where the GPU supports it, else fp16
    autocast with a GradScaler. bf16 autocast is also there on the CPU, and on MPS where the
    installed torch and macOS support it (`mps_bf16_supported`). The weights and the optimizer
    stay fp32 in every case.

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
    if dtype == "bfloat16" and (
        device.type == "cpu" or (device.type == "mps" and mps_bf16_supported())
    ):
        return dtype, torch.bfloat16, False
    if device.type == "mps":
        raise InputError(
            f"train.dtype ({dtype!r}) is not supported on mps here: use float32 or auto"
            + (
                " (bfloat16 needs macOS 14 or newer and a torch with autocast on MPS; this is "
                f"torch {torch.__version__})."
                if dtype == "bfloat16"
                else ", or bfloat16 on macOS 14 or newer (float16 would need loss scaling)."
            )
        )
    raise InputError(
        f"train.dtype ({dtype!r}) is not supported on {device.type}: use float32 or auto"
        + (" (or bfloat16)" if device.type == "cpu" else "")
        + "."
    )


def mps_bf16_supported() -> bool:
    """Whether bf16 autocast can train on Apple's MPS here: the installed torch has autocast for
    MPS, and macOS is 14 (Sonoma) or newer, where Metal has bf16 arithmetic."""
    mps = getattr(torch.backends, "mps", None)
    if mps is None or not mps.is_available() or not torch.amp.is_autocast_available("mps"):
        return False
    newer = getattr(mps, "is_macos_or_newer", None)  # torch >= 2.2
    return bool(newer is not None and newer(14, 0))


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
    _unscaled: bool = field(default=False, repr=False)  # `clip` unscaled this step's gradients

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
        norm = self.clip(optimizer, params, grad_clip, want_norm)
        self.finish(optimizer)
        return norm

    def clip(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[Any],
        grad_clip: float,
        want_norm: bool = False,
        inspect: Callable[[], None] | None = None,
    ) -> torch.Tensor | None:
        """The first half of `step`: unscale the gradients (fp16) and clip their global norm.

        `inspect` is called with the true (unscaled, unclipped) gradients in place, for
        measurements that must see them. Returns the norm as `step` does.
        """
        norm = None
        self._unscaled = False
        if grad_clip > 0 or want_norm or inspect is not None:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)  # the norm of the true gradients
                self._unscaled = True
            if inspect is not None:
                inspect()
            if grad_clip > 0:
                norm = nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
            elif want_norm:
                grads = [p.grad for p in params if p.grad is not None]
                norm = nn.utils.get_total_norm(grads, foreach=True)  # what clipping measures
        return norm

    def finish(self, optimizer: torch.optim.Optimizer, apply: bool = True) -> None:
        """The second half of `step`: step with the gradients (`apply`) or drop them; zero them.

        A dropped step leaves the weights and the optimizer's moments and step count as they
        were; with a GradScaler that unscaled this step, its scale is updated as after a step
        it skipped itself.
        """
        if apply and self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        elif apply:
            optimizer.step()
        elif self.scaler is not None and self._unscaled:
            self.scaler.update()  # clears the step's recorded inf checks, else unscale_ refuses
        optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
