"""The optimizer (parameter groups) and the learning-rate schedule.

`build_optimizer` is the one place an optimizer is made from a config: `torch.optim.AdamW`, or
Muon for the hidden matrices beside torch's AdamW for the rest (`llmcli.training.muon`). Every
param group keeps its peak learning rate under `"base_lr"`; `apply_lr` scales all groups by the
schedule's factor `lr_at(step) / train.lr`, so groups with their own peak (a Muon group at
`muon_lr`, say) follow the same warmup and decay.

Schedules, for the 0-based optimizer step `s` with `N = max_steps` and
`W = min(warmup_steps, N)` (a warmup longer than the run is cut to it):
- warmup (both): `lr * (s + 1) / (W + 1)` for `s < W`, so the rate is never 0 at step 0;
- `cosine`: `min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2` with `p = (s - W) / (N - 1 - W)`;
- `wsd` (warmup, stable, decay): `lr` until the last `decay_fraction * N` steps, then a linear
  decay reaching `min_lr` at the last step.
Both reach their peak at step `W` and `min_lr` at the last step, `N - 1`.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from llmcli.config import TrainConfig
from llmcli.errors import ConfigError
from llmcli.training.muon import AdamWDefaults, Muon, muon_param_groups

Named = list[tuple[str, nn.Parameter]]


def _trainable(model: nn.Module) -> Named:
    """(name, parameter) of every trainable parameter; a tied one appears once."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _group(named: Named, **options: Any) -> dict[str, Any]:
    return {"params": [p for _, p in named], "names": [name for name, _ in named], **options}


def _decay_split(named: Named, no_decay: Collection[str]) -> tuple[Named, Named]:
    """(matrices and embeddings, dim >= 2: decayed; biases, norm gains and `no_decay`: not)."""
    decayed = [(n, p) for n, p in named if p.dim() >= 2 and n not in no_decay]
    return decayed, [(n, p) for n, p in named if p.dim() < 2 or n in no_decay]


def param_groups(
    model: nn.Module, weight_decay: float, no_decay: Collection[str] = ()
) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on matrices and embeddings (dim >= 2), none on the rest.

    Biases and norm gains (dim < 2) are not decayed, as in GPT-2 / nanoGPT: shrinking them
    towards 0 does not regularise and hurts. A tied weight (embedding = LM head) appears once.
    The parameters named in `no_decay` are not decayed either: a LoRA run's token embedding,
    whose frozen rows decay would change (`llmcli.model.lora.train_token_rows`).

    Returns:
        `[{"params": decay, "weight_decay": weight_decay}, {"params": no_decay,
        "weight_decay": 0.0}]`, each with `"names"` listing the parameter names.
    """
    decay, kept = _decay_split(_trainable(model), no_decay)
    return [_group(decay, weight_decay=weight_decay), _group(kept, weight_decay=0.0)]


def build_optimizer(
    model: nn.Module, train: TrainConfig, device_type: str, no_decay: Collection[str] = ()
) -> torch.optim.Optimizer:
    """The optimizer `train.optimizer` names, with its groups at their peak learning rate.

    AdamW uses the fused kernel on CUDA and the CPU, the foreach one elsewhere; "muon"
    is `llmcli.training.muon.Muon` over `muon_param_groups` (Muon at `train.muon_lr` for hidden
    matrices, torch's AdamW, with the same kernel choice, at `train.lr` for the rest).

    Args:
        model: the (unwrapped) model whose parameters are optimised.
        train: the train section of the config (optimizer, lr, betas, weight_decay, ...).
        device_type: "cuda", "mps" or "cpu".
        no_decay: names of matrices kept out of weight decay (`param_groups`).

    Raises:
        ConfigError: an optimizer this build does not provide.
    """
    # The fused kernel exists for CUDA and the CPU (about twice as fast as foreach there).
    fused = device_type in ("cuda", "cpu")
    if train.optimizer == "adamw":
        groups = param_groups(model, train.weight_decay, no_decay)
        for group in groups:
            group["base_lr"] = train.lr
            group["lr"] = train.lr
        kernel = {"fused": True} if fused else {"foreach": True}
        return torch.optim.AdamW(
            groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=1e-8, **kernel
        )
    if train.optimizer == "muon":
        return Muon(
            muon_param_groups(model, train, param_groups(model, train.weight_decay, no_decay)),
            momentum=train.muon_momentum,
            adamw=AdamWDefaults(betas=(train.beta1, train.beta2), eps=1e-8, fused=fused),
        )
    raise ConfigError(
        f"train.optimizer ({train.optimizer!r}) is not available in this version of llmcli; "
        "use train.optimizer=adamw."
    )


def _progress(step: int, start: int, max_steps: int) -> float:
    """Fraction of the way from `start` to the last step `max_steps - 1`, clamped to [0, 1]."""
    span = max_steps - 1 - start
    if span <= 0:
        return 1.0
    return min(1.0, max(0.0, (step - start) / span))


def learning_rate(
    step: int,
    *,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    max_steps: int,
    schedule: str = "cosine",
    decay_fraction: float = 0.2,
) -> float:
    """The learning rate for 0-based optimizer step `step` (see the module docstring)."""
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if schedule == "cosine":
        p = _progress(step, warmup_steps, max_steps)
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * max_steps))
        decay_start = max(warmup_steps, max_steps - decay_steps)
        if step < decay_start:
            return lr
        return lr + (min_lr - lr) * _progress(step, decay_start, max_steps)
    raise ConfigError(f"train.schedule ({schedule!r}) must be 'cosine' or 'wsd'.")


def lr_at(step: int, train: TrainConfig) -> float:
    """`learning_rate` with the values of the train config."""
    return learning_rate(
        step,
        lr=train.lr,
        min_lr=train.min_lr,
        warmup_steps=train.warmup,
        max_steps=train.max_steps,
        schedule=train.schedule,
        decay_fraction=train.decay_fraction,
    )


def apply_lr(
    optimizer: torch.optim.Optimizer, step: int, train: TrainConfig, scale: float = 1.0
) -> float:
    """Set every group's lr for `step` (its `base_lr` times the schedule's factor, times
    `scale`: the spike guard's lowering after a rollback); returns the rate of the base
    schedule (`lr_at(step) * scale`)."""
    lr = lr_at(step, train) * scale
    factor = lr / train.lr
    for group in optimizer.param_groups:
        group["lr"] = group.get("base_lr", train.lr) * factor
    return lr
