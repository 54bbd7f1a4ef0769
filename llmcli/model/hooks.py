"""Hook points: named places in the forward where a caller reads or replaces an activation.

Every activation a reader may want passes through a `HookPoint`, an identity module named by
where it sits in the model (`blocks.0.attn.z`), as TransformerLens does. Looking inside is then a
caller's function run at a name, never a new argument of `forward`:

    with model.hooks({"blocks.0.attn.pattern": seen.append}):   # read
        model(idx)
    with model.hooks({"blocks.0.attn.z": zero_head_2}):         # replace: return a tensor
        logits, _ = model(idx)

A function gets the activation; if it returns a tensor, that tensor goes on in its place (None
keeps the activation). A point with no function costs one identity call, and `attn.pattern` is
computed at all only while a function is at it (see `MultiHeadAttention`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from torch import Tensor, nn

from llmcli.errors import InputError

HookFn = Callable[[Tensor], Tensor | None]


class HookPoint(nn.Module):
    """An identity on the activation that passes through it, unless functions are added.

    Attributes:
        fns: the functions run on the activation, in order; each may replace it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fns: list[HookFn] = []

    @property
    def active(self) -> bool:
        """Whether any function is at this point (a forward may skip work nobody reads)."""
        return bool(self.fns)

    def forward(self, x: Tensor) -> Tensor:
        for fn in self.fns:
            out = fn(x)
            if out is not None:
                x = out
        return x


def hook_names(module: nn.Module) -> list[str]:
    """The names of every hook point in `module`, in the order the forward meets them."""
    return [name for name, m in module.named_modules() if isinstance(m, HookPoint)]


@contextmanager
def hooked(module: nn.Module, fns: Mapping[str, HookFn]) -> Iterator[None]:
    """Run `fns[name]` at each named hook point of `module` while the block runs.

    Args:
        module: a model (or any module holding hook points; names are relative to it).
        fns: hook point name -> function of the activation; a returned tensor replaces it.

    Raises:
        InputError: a name that is not a hook point of `module` (the message lists close ones).
    """
    points = {name: m for name, m in module.named_modules() if isinstance(m, HookPoint)}
    for name in fns:
        if name not in points:
            close = difflib.get_close_matches(name, list(points), n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise InputError(
                f"{name!r} is not a hook point of this model: {hint}`model.hook_names()` lists "
                f"them all ({', '.join(list(points)[:4])}, ...)."
            )
    added = []
    try:
        for name, fn in fns.items():
            points[name].fns.append(fn)
            added.append((points[name], fn))
        yield
    finally:
        for point, fn in added:
            point.fns.remove(fn)
