"""The `model:` section: the network's shape and its architecture options.

`ModelConfig` checks itself as it is made and cannot be changed after (`dataclasses.replace`
makes a new one, checked again), so every module built from one (`Block(config)`,
`llmcli.model.gpt`) can trust it: the modules do not check it again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmcli.config.rules import check_choices, divisors, require
from llmcli.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    """The network's shape and architecture options (a GPT-2-style model by default)."""

    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block
    n_embed: int = 128  # channels of the residual stream (C)
    context_length: int = 64  # the most tokens the model sees at once (T)
    dropout: float = 0.0  # dropout on the residual stream
    # Dropout on the attention weights; null: `dropout`. On the CPU, attention with dropout
    # leaves the fused kernel for one that writes out the weights (about 2.5x its time), so a
    # recipe can keep dropout on the residual stream and turn this one off.
    attn_dropout: float | None = None
    bias: bool = True  # biases in the linear layers and LayerNorms
    # Recipe options (all off by default, so the default model is GPT-2's architecture).
    pos_emb: Literal["learned", "rope"] = "learned"  # learned position embeddings, or rotary (RoPE)
    rope_base: float = 10000.0  # RoPE's base frequency
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"  # LayerNorm, or RMSNorm (no mean, no bias)
    qk_norm: bool = False  # RMSNorm on queries and keys
    mlp: Literal["gelu", "relu2"] = "gelu"  # GELU, or squared ReLU
    tie_embeddings: bool = True  # the LM head is the token embedding

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_size(self) -> int:
        """`hs`, the channels of one attention head: `n_embed // n_head`."""
        return self.n_embed // self.n_head

    @property
    def attention_dropout(self) -> float:
        """The dropout on the attention weights: `attn_dropout`, else `dropout`."""
        return self.dropout if self.attn_dropout is None else self.attn_dropout

    def validate(self) -> None:
        """Raise `ConfigError` for a value that breaks its rule (the message names both)."""
        for key in ("n_layer", "n_head", "n_embed", "context_length"):
            require(getattr(self, key) > 0, "model", key, getattr(self, key), "must be positive")
        if self.n_embed % self.n_head != 0:
            raise ConfigError(
                f"model.n_embed ({self.n_embed}) must be divisible by model.n_head "
                f"({self.n_head}): pick n_head among {divisors(self.n_embed, limit=64)} "
                f"or change n_embed."
            )
        check_choices("model", self)
        require(0 <= self.dropout < 1, "model", "dropout", self.dropout, "must be in [0, 1)")
        require(
            self.attn_dropout is None or 0 <= self.attn_dropout < 1,
            "model",
            "attn_dropout",
            self.attn_dropout,
            "must be in [0, 1), or null for model.dropout",
        )
        require(self.rope_base > 0, "model", "rope_base", self.rope_base, "must be positive")
        if self.pos_emb == "rope":
            require(
                self.head_size % 2 == 0,
                "model",
                "pos_emb",
                self.pos_emb,
                f"needs an even head size (n_embed / n_head = {self.head_size})",
            )
