"""The model: `Head` -> `MultiHeadAttention` -> `MLP` -> `Block` -> `Transformer` (`gpt`), each
built from a `ModelConfig`; how attention is computed and masked (`attention`); the recipe
options' layers (`layers`); the hook points every look inside goes through (`hooks`); the
generation cache (`kv_cache`).
"""

from llmcli.model.attention import AttentionContext
from llmcli.model.gpt import MLP, Block, Head, MultiHeadAttention, Transformer
from llmcli.model.hooks import HookPoint, hooked
from llmcli.model.kv_cache import KVCache

__all__ = [
    "MLP",
    "AttentionContext",
    "Block",
    "Head",
    "HookPoint",
    "KVCache",
    "MultiHeadAttention",
    "Transformer",
    "hooked",
]
