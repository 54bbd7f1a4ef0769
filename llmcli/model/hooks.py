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

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from torch import Tensor, nn

from llmcli.errors import InputError, did_you_mean

HookFn = Callable[[Tensor], Tensor | None]


class HookPoint(nn.Module):
    """An identity on the activation that passes through it, unless functions are added.

    Attributes:
        fns: the functions run on the activation, in order; each may replace it.
        name: where the point sits in the model (set by `hooked`, for messages).
    """

    def __init__(self) -> None:
        super().__init__()
        self.fns: list[HookFn] = []
        self.name = ""

    @property
    def active(self) -> bool:
        """Whether any function is at this point (a forward may skip work nobody reads)."""
        return bool(self.fns)

    def forward(self, x: Tensor) -> Tensor:
        for fn in self.fns:
            out = fn(x)
            if out is not None:
                _check_replacement(self.name, x, out)
                x = out
        return x


def _check_replacement(name: str, x: Tensor, out: object) -> None:
    """Raise `InputError` unless `out` can stand where `x` was: a tensor of its shape, dtype and
    device (anything else would flow on as a wrong answer or fail far from the hook)."""
    if not isinstance(out, Tensor):
        raise InputError(
            f"the function at hook point {name!r} returned a {type(out).__name__}: return a "
            "tensor to replace the activation, or None to keep it."
        )
    if (out.shape, out.dtype, out.device) != (x.shape, x.dtype, x.device):
        raise InputError(
            f"the function at hook point {name!r} returned a tensor of shape "
            f"{tuple(out.shape)}, {out.dtype} on {out.device}, where the activation is "
            f"{tuple(x.shape)}, {x.dtype} on {x.device}: a replacement must match it."
        )


def hook_names(module: nn.Module) -> list[str]:
    """The names of every hook point in `module`, in the order the forward meets them."""
    return [name for name, m in module.named_modules() if isinstance(m, HookPoint)]


@contextmanager
def hooked(module: nn.Module, fns: Mapping[str, HookFn | list[HookFn]]) -> Iterator[None]:
    """Run `fns[name]` at each named hook point of `module` while the block runs: a function, or
    a list of them run in the order given (each on what the one before left).

    The functions leave with the block, also when it raises. Under `torch.compile` a new function
    recompiles the forward (the compiled graph guards on them): hook the module itself, not its
    compiled wrapper.

    Args:
        module: a model (or any module holding hook points; names are relative to it).
        fns: hook point name -> function of the activation (or a list of them); a returned
            tensor (of the activation's shape, dtype and device) replaces it.

    Raises:
        InputError: a name that is not a hook point of `module` (the message lists close ones),
            or a value that is not callable.
    """
    points = {name: m for name, m in module.named_modules() if isinstance(m, HookPoint)}
    each = [(name, f) for name, fn in fns.items() for f in (fn if isinstance(fn, list) else [fn])]
    for name, fn in each:
        if name not in points:
            hint = did_you_mean(name, points, "did you mean {}? ", n=3, cutoff=0.6)
            raise InputError(
                f"{name!r} is not a hook point of this model: {hint}`model.hook_names()` lists "
                f"them all ({', '.join(list(points)[:4])}, ...)."
            )
        if not callable(fn):
            raise InputError(f"the hook for {name!r} is a {type(fn).__name__}, not a function.")
    added = []
    try:
        for name, fn in each:
            points[name].name = name
            points[name].fns.append(fn)
            added.append((points[name], fn))
        yield
    finally:
        for point, fn in reversed(added):  # by identity: equal functions may stand at one point
            del point.fns[max(i for i, f in enumerate(point.fns) if f is fn)]
