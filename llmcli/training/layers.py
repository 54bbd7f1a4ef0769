"""Network health at log steps (`train.log_layers`): each layer's gradient norm and update ratio.

The parameters fall into groups by name: `embed` (the token and position embeddings),
`blocks.{l}` (layer l) and `final` (the final norm, and the LM head when it is not tied to the
embedding). For each group, a log step's record gets (`metrics.jsonl`: `"layers": {group:
{"grad_norm": ..., "update_ratio": ...}}`; trackers: `layers/<group>/grad_norm`, ...):

- `grad_norm`: the L2 norm of the group's gradients, all its parameters together, before
  clipping (the squares of the groups' norms add up to the global `grad_norm`'s square);
- `update_ratio`: ||w_after - w_before|| / ||w_before||, all the group's parameters together,
  measured as the weights' change over the step (the learning rate, Adam's normalised update
  and weight decay in one figure). Around 1e-3 is the usual healthy size with Adam; much
  larger in one group points at too high a rate for it, much smaller at a group that barely
  learns.

Measured on rank 0 at log steps only: a copy of the weights before the step, a few norms.
"""

from __future__ import annotations

import torch
from torch import nn


def layer_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The trainable parameters by group, in the model's order (a tied weight appears once)."""
    groups: dict[str, list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        parts = name.split(".")
        if parts[0] == "blocks":
            group = ".".join(parts[:2])
        elif parts[0] in ("wte", "wpe"):
            group = "embed"
        else:
            group = "final"
        groups.setdefault(group, []).append(param)
    return groups


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of `tensors` taken together, a 0-d fp32 tensor (0 for none)."""
    if not tensors:
        return torch.zeros(())
    return nn.utils.get_total_norm([t.float() for t in tensors], foreach=True)


class LayerWatch:
    """One optimizer step's per-group gradient norms and update-to-weight ratios.

    It is the training step's `before_update`: it reads the gradients (the true ones, before
    clipping) and keeps the weights before the update; `record`, after the step, measures the
    update and reads every figure from the device at once.
    """

    def __init__(self, model: nn.Module) -> None:
        self.groups = layer_groups(model)
        self.grad_norms: dict[str, torch.Tensor] = {}
        self.ratios: dict[str, torch.Tensor] = {}
        self._before: dict[str, list[torch.Tensor]] = {}

    def __call__(self, loss: torch.Tensor, norm: torch.Tensor) -> bool:
        """`train_step`'s `before_update`: read the gradients, keep the weights; never refuses."""
        for name, params in self.groups.items():
            self.grad_norms[name] = _norm([p.grad for p in params if p.grad is not None])
        self._before = {
            name: [p.detach().clone() for p in params] for name, params in self.groups.items()
        }
        return True

    def record(self) -> dict[str, dict[str, float]]:
        """After the step: `{group: {"grad_norm": ..., "update_ratio": ...}}`, read from the
        device at once."""
        for name, params in self.groups.items():
            before = self._before[name]
            change = _norm([p.detach() - b for p, b in zip(params, before, strict=True)])
            self.ratios[name] = change / _norm(before)
        self._before = {}
        names = list(self.groups)
        values = torch.stack(
            [self.grad_norms[n].cpu() for n in names] + [self.ratios[n].cpu() for n in names]
        ).tolist()
        k = len(names)
        return {
            name: {"grad_norm": values[i], "update_ratio": values[k + i]}
            for i, name in enumerate(names)
        }
