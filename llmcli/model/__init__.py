"""The model: `Head` -> `MultiHeadAttention` -> `MLP` -> `Block` -> `Transformer` (`gpt`), each
built from a `ModelConfig`, each forward the maths on `(B, T, C)` with the mask, positions and
cache a caller built; the recipe options' layers (`layers`); the hook points every look inside
goes through (`hooks`); the generation cache (`kv_cache`); a fused attention layer and its
separate heads, converted both ways (`heads`).
"""

from llmcli.model.gpt import MLP, Block, Head, MultiHeadAttention, Transformer, causal_mask
from llmcli.model.hooks import HookPoint, hooked
from llmcli.model.kv_cache import KVCache

__all__ = [
    "MLP",
    "Block",
    "Head",
    "HookPoint",
    "KVCache",
    "MultiHeadAttention",
    "Transformer",
    "causal_mask",
    "hooked",
]
