"""The precision a training step computes in: the autocast context and loss scaling.

`resolve_precision` turns `train.dtype` into what a device can train in; `Precision` holds what a
step does differently per precision: the autocast context, and a GradScaler that scales the loss
only under fp16 (elsewhere it is disabled, and its `scale`, `unscale_`, `step` and `update` pass
through, as in nanoGPT), so that `llmcli.training.step.train_step` reads the same for all of
them. The training loop, `llmcli plan` and `llmcli bench` step and evaluate through it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

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
    """How a training step computes: the autocast context and loss scaling.

    Attributes:
        name: "float32", "bfloat16" or "float16".
        device: where the model runs.
        autocast_dtype: the dtype of autocast regions, None for plain fp32.
        scaler: the GradScaler, enabled for fp16 only (disabled, each of its calls passes
            through: `scale(loss)` is `loss`, `step(optimizer)` is `optimizer.step()`).
    """

    name: str
    device: torch.device
    autocast_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler

    @classmethod
    def resolve(cls, device: torch.device, dtype: str) -> Precision:
        """The precision `train.dtype` asks for on `device` (see `resolve_precision`)."""
        name, amp_dtype, use_scaler = resolve_precision(device, dtype)
        return cls(name, device, amp_dtype, torch.amp.GradScaler(device.type, enabled=use_scaler))

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is scaled (fp16): non-finite gradients are then the scaler's to skip."""
        return self.scaler.is_enabled()

    def forget_step(self) -> None:
        """Drop what the GradScaler recorded of a step abandoned half-way (out of memory after
        `unscale_`), keeping its scale: a fresh scaler with its state."""
        state = self.scaler.state_dict()
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.scaler.is_enabled())
        if state:
            self.scaler.load_state_dict(state)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context a forward pass runs in (a no-op for fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)
