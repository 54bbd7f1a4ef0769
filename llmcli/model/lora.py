"""Low-rank adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models").

A targeted linear layer keeps its weight `W (out, in)` frozen and learns a low-rank update
beside it: `y = x W^T + b + dropout(x) A^T B^T * alpha / r`, with `A (r, in)` initialised as
PEFT's (`kaiming_uniform_(a=sqrt(5))`) and `B (out, r)` zeros, so an adapted model starts as the
base. `merged_weight` folds the update in: `W + B A * alpha / r`.

`add_lora` swaps each targeted `nn.Linear` of every block for a `LoRALinear` holding the same
weight and bias Parameters, so the base's parameter names stay what checkpoints, exports and
the hook points know (`blocks.0.attn.qkv.weight`), and the adapters sit beside them as
`blocks.0.attn.qkv.lora_A` / `lora_B`. `merged_state_dict` gives the weights of the plain model
the adapted one equals, for readers that know nothing of adapters.

Tokens a fine-tune adds (the chat tokens, `llmcli.training.init_from.grow_vocab`) have no
trained rows in the base: `train_token_rows` keeps those rows of the token embedding (and of an
untied LM head) trainable while the rest of the matrix stays frozen, by zeroing the gradient of
the base's rows. PEFT keeps such rows as `trainable_token_indices`, their values under
`token_adapter.trainable_tokens_delta`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmcli.config import LoraConfig
from llmcli.errors import InputError

# The names of an adapter's matrices end in these (`blocks.0.attn.qkv.lora_A`).
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


class LoRALinear(nn.Linear):
    """A linear layer with a trainable low-rank update beside its frozen weight.

    A subclass of `nn.Linear` rather than a wrapper around one: its `weight` and `bias` keep
    their names (a wrapper would rename them `base.weight`), and code that looks for linear
    layers (the optimizer's matrix groups, `llmcli.training.layers`) still finds it.

    Args:
        base: the layer adapted; its weight and bias Parameters are shared, not copied.
        config: `train.lora`: rank r, alpha, dropout.
        generator: random generator for `A`'s initial values (default: torch's global one).

    Shape:
        `(..., in)` -> `(..., out)`
    """

    def __init__(
        self, base: nn.Linear, config: LoraConfig, generator: torch.Generator | None = None
    ) -> None:
        out_features, in_features = base.weight.shape
        # "meta": nn.Linear's own weight is replaced at once by the base's; allocate nothing.
        super().__init__(in_features, out_features, base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        r, kind = config.rank, {"device": base.weight.device, "dtype": base.weight.dtype}
        if r > min(in_features, out_features):
            raise InputError(
                f"train.lora.rank ({r}) is larger than a {in_features} -> {out_features} layer "
                f"can use: choose at most {min(in_features, out_features)}."
            )
        self.lora_A = nn.Parameter(torch.empty(r, in_features, **kind))  # (r, in)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        self.lora_B = nn.Parameter(torch.zeros(out_features, r, **kind))  # (out, r)
        self.lora_dropout = nn.Dropout(config.dropout)
        self.scaling = config.scaling  # alpha / r

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)  # (..., out)
        h = F.linear(self.lora_dropout(x), self.lora_A)  # (..., in) @ (in, r) -> (..., r)
        return y + F.linear(h, self.lora_B) * self.scaling  # (..., r) @ (r, out) -> (..., out)

    def merged_weight(self) -> Tensor:
        """`W + B A * alpha / r`, `(out, in)`: the plain layer's weight this one equals (in
        eval mode), detached."""
        with torch.no_grad():
            return self.weight + (self.lora_B @ self.lora_A) * self.scaling  # (out, in)


def adapted_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(name, layer) of every adapted layer of `model`, e.g. `("blocks.0.attn.qkv", ...)`."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def add_lora(
    model: nn.Module, config: LoraConfig, generator: torch.Generator | None = None
) -> None:
    """Put a `LoRALinear` in place of each targeted layer of every block of a `Transformer`
    (`config.targets`: `attn.qkv`, `attn.proj`, `mlp.fc`, `mlp.proj`), in place.

    The base's Parameters are the same objects afterwards: build the optimizer after this.

    Raises:
        InputError: a rank larger than a layer's smaller side.
    """
    for block in model.blocks:
        for target in config.targets:
            owner_name, attr = target.split(".")
            owner = getattr(block, owner_name)
            setattr(owner, attr, LoRALinear(getattr(owner, attr), config, generator))


def freeze_base(model: nn.Module) -> None:
    """Make only the adapters trainable: every other parameter's `requires_grad` False."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(ADAPTER_SUFFIXES))


def token_row_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The vocabulary-sized matrices whose new rows `train_token_rows` trains: the token
    embedding, and the LM head when it is its own matrix."""
    params = {"wte.weight": model.wte.weight}
    if model.lm_head.weight is not model.wte.weight:
        params["lm_head.weight"] = model.lm_head.weight
    return params


def grow_rows(tensor: Tensor, rows: int) -> Tensor:
    """`tensor (V0, ...)` with rows appended up to `rows` (> V0), each the mean of its rows:
    how the rows of tokens a fine-tune adds start (`llmcli.training.init_from.grow_vocab`), and
    so what a LoRA run's exported base holds in them (`llmcli.hf.lora`)."""
    mean = tensor.float().mean(dim=0, keepdim=True).to(tensor.dtype)  # (1, ...)
    return torch.cat([tensor, mean.expand(rows - tensor.shape[0], *tensor.shape[1:])])


def train_token_rows(model: nn.Module, first: int) -> list[str]:
    """Make rows `first:` of the token embedding (and an untied LM head) trainable, the rows
    before them frozen: their gradient is zeroed as it is computed, so an optimizer without
    weight decay on these matrices leaves those rows bitwise unchanged (Adam's update of a
    parameter whose gradients were all zero is zero). Returns the names made trainable; none
    when the vocabulary did not grow (`first` is the model's vocabulary size)."""
    if first >= model.vocab_size:
        return []
    params = token_row_params(model)
    for p in params.values():
        keep = torch.zeros(p.shape[0], 1, dtype=p.dtype, device=p.device)  # (V, 1)
        keep[first:] = 1.0
        p.requires_grad_(True)
        p.register_hook(lambda grad, keep=keep: grad * keep.to(grad.device))  # (V, C)
    return list(params)


def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The state dict of the plain model the adapted `model` equals: each adapted layer's
    weight merged (`LoRALinear.merged_weight`), the adapters left out. Tied tensors stay one
    tensor, as in `model.state_dict()`."""
    merged = {f"{name}.weight": layer.merged_weight() for name, layer in adapted_layers(model)}
    return {
        name: merged.get(name, tensor)
        for name, tensor in model.state_dict().items()
        if not name.endswith(ADAPTER_SUFFIXES)
    }


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' part of `model.state_dict()`: every `lora_A` and `lora_B`, by name."""
    return {n: t for n, t in model.state_dict().items() if n.endswith(ADAPTER_SUFFIXES)}


def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its layer's weight and put a plain `nn.Linear` back in its place,
    in place: the model then has the plain model's parameters and forward."""
    for name, layer in list(adapted_layers(model)):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        # "meta": no random initial values drawn, as they are replaced at once
        plain = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
        plain.weight = nn.Parameter(layer.merged_weight(), layer.weight.requires_grad)
        plain.bias = layer.bias
        setattr(owner, attr, plain)


def lora_parameters(model: nn.Module) -> int:
    """The number of adapter parameters (`lora_A` and `lora_B` of every adapted layer)."""
    return sum(layer.lora_A.numel() + layer.lora_B.numel() for _, layer in adapted_layers(model))
