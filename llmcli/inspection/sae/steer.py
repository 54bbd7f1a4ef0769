"""Changing the model through an SAE, at its hook point: the hook functions, and the options.

- `splice`: the activation replaced by the SAE's reconstruction (what `sae eval` scores);
- `steer`: `scale` times a feature's decoder direction added at every position
  (`llmcli sample --steer SAE_DIR:FEATURE=SCALE`): the model runs as if the feature were that
  much more active (Templeton et al. 2024, "Scaling Monosemanticity");
- `ablate`: a feature removed: its activation times its direction taken out of the activation,
  the SAE's reconstruction error left in, so nothing else the SAE misses is lost
  (`llmcli eval --ablate-feature SAE_DIR:FEATURE`).

`steering_hooks` and `ablation_hooks` turn the options into `{hook point: function}` for
`model.hooks`; several at one point run in the order given.
The SAE goes to the model's device and dtype.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from llmcli.errors import InputError
from llmcli.inspection.sae.folder import LoadedSAE, load_sae
from llmcli.inspection.sae.model import SparseAutoencoder
from llmcli.inspection.sae.points import check_hook, replacing
from llmcli.model.hooks import HookFn

# SAE_DIR:FEATURE[=SCALE]: the folder may hold colons itself, so the feature is the last colon's.
_SPEC = re.compile(r"(?P<folder>.+):(?P<feature>[0-9]{1,9})(?:=(?P<scale>[^=]+))?")


def splice(sae: SparseAutoencoder) -> HookFn:
    """A hook function that replaces the activation by `sae`'s reconstruction of it."""
    return replacing(sae)


def steer(sae: SparseAutoencoder, feature: int, scale: float) -> HookFn:
    """A hook function that adds `scale * W_dec[feature]` to every position's activation."""
    direction = sae.W_dec[feature].detach()  # (d_in,)
    return replacing(lambda rows: rows + scale * direction)


def ablate(sae: SparseAutoencoder, feature: int) -> HookFn:
    """A hook function that takes `feature`'s part, `acts[:, feature] * W_dec[feature]`, out of
    the activation."""
    direction = sae.W_dec[feature].detach()  # (d_in,)

    def remove(rows: Tensor) -> Tensor:  # (N, d_in)
        acts = sae.encode(rows)[:, feature]  # (N,)
        return rows - acts[:, None] * direction

    return replacing(remove)


def _parse(spec: str, option: str, scaled: bool) -> tuple[str, int, float]:
    """`SAE_DIR:FEATURE=SCALE` (or `SAE_DIR:FEATURE`) -> (folder, feature, scale)."""
    form = "SAE_DIR:FEATURE=SCALE (e.g. checkpoints/tiny/sae/blocks.1.resid_post:12=8)"
    if not scaled:
        form = "SAE_DIR:FEATURE (e.g. checkpoints/tiny/sae/blocks.1.resid_post:12)"
    match = _SPEC.fullmatch(spec.strip())
    if match is None or (match["scale"] is None) == scaled:
        raise InputError(f"{option} {spec!r}: write {form}.")
    scale = 0.0
    if scaled:
        try:
            scale = float(match["scale"])
        except ValueError:
            raise InputError(f"{option} {spec!r}: SCALE must be a number; write {form}.") from None
        if not torch.isfinite(torch.tensor(scale)):
            raise InputError(f"{option} {spec!r}: SCALE must be a finite number.")
    return match["folder"], int(match["feature"]), scale


def _hooks(
    model: nn.Module,
    specs: Sequence[str],
    option: str,
    make: Callable[[SparseAutoencoder, int, float], HookFn],
    scaled: bool,
) -> dict[str, list[HookFn]]:
    """`{hook point: [function, ...]}` for `specs` (`model.hooks` runs a point's in turn)."""
    loaded: dict[str, LoadedSAE] = {}
    at: dict[str, list[HookFn]] = {}
    weight = next(model.parameters())
    for spec in specs:
        folder, feature, scale = _parse(spec, option, scaled)
        if folder not in loaded:
            found = load_sae(Path(folder))
            found.sae.to(weight.device, weight.dtype)
            if check_hook(model, found.info.hook) != found.sae.d_in:
                raise InputError(
                    f"{option} {spec!r}: the SAE reads {found.sae.d_in} channels at "
                    f"{found.info.hook}, and this model has another width there."
                )
            loaded[folder] = found
        sae = loaded[folder]
        if not 0 <= feature < sae.sae.d_sae:
            raise InputError(
                f"{option} {spec!r}: feature {feature} is past the SAE's last "
                f"({sae.sae.d_sae - 1})."
            )
        at.setdefault(sae.info.hook, []).append(make(sae.sae, feature, scale))
    return at


def steering_hooks(model: nn.Module, specs: Sequence[str]) -> dict[str, list[HookFn]]:
    """The hook functions of `--steer SAE_DIR:FEATURE=SCALE` options, for `model.hooks`.

    Raises:
        InputError: a spec of another form, an SAE folder that cannot be read or does not fit
            the model, a feature the SAE does not have.
    """
    return _hooks(model, specs, "--steer", steer, scaled=True)


def ablation_hooks(model: nn.Module, specs: Sequence[str]) -> dict[str, list[HookFn]]:
    """The hook functions of `--ablate-feature SAE_DIR:FEATURE` options, for `model.hooks`.

    Raises:
        InputError: as `steering_hooks`.
    """
    return _hooks(model, specs, "--ablate-feature", lambda s, f, _: ablate(s, f), scaled=False)
