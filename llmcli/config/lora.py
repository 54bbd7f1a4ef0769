"""The `train.lora:` settings: low-rank adapters (Hu et al. 2021, "LoRA") on a frozen base.

A mapping under `train:` (null: a full fine-tune). Its rank, alpha and dropout default to PEFT's
`LoraConfig`'s (r 8, lora_alpha 8, lora_dropout 0: a scale of 1); the targets are llmcli's own
module names inside each block, which the Hugging Face export maps to its layouts' names (GPT-2's
`c_attn`, NeoX's `query_key_value`, ...). PEFT's default targets depend on the model type (GPT-2:
`c_attn` alone); llmcli adapts all four of a block's linear layers unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmcli.config.rules import require
from llmcli.errors import ConfigError, did_you_mean

# The linear layers of a block that may carry an adapter: attention's fused QKV and output
# projections, and the MLP's two layers (`llmcli.model.gpt`).
LORA_TARGETS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")


@dataclass
class LoraConfig:
    """Low-rank adapters on the frozen `train.init_from` model."""

    rank: int = 8  # r: the adapters' inner size (at most model.n_embed)
    alpha: float = 8.0  # the update is scaled by alpha / rank (PEFT's lora_alpha default)
    dropout: float = 0.0  # dropout on an adapter's input, in training
    # the layers of every block that get an adapter: attn.qkv, attn.proj, mlp.fc, mlp.proj
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))

    @property
    def scaling(self) -> float:
        """The factor on the low-rank update, `alpha / rank`."""
        return self.alpha / self.rank

    def validate(self) -> None:
        require(self.rank >= 1, "train.lora", "rank", self.rank, "must be >= 1")
        require(self.alpha > 0, "train.lora", "alpha", self.alpha, "must be > 0")
        require(0 <= self.dropout < 1, "train.lora", "dropout", self.dropout, "must be in [0, 1)")
        require(
            len(self.targets) > 0,
            "train.lora",
            "targets",
            self.targets,
            f"must name at least one layer among {', '.join(LORA_TARGETS)}",
        )
        for name in self.targets:
            if name not in LORA_TARGETS:
                hint = did_you_mean(name, LORA_TARGETS)
                raise ConfigError(
                    f"train.lora.targets: {name!r} is not a layer an adapter can go on.{hint} "
                    f"The layers are {', '.join(LORA_TARGETS)}."
                )
