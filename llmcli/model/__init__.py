"""The model: `Head` -> `MultiHeadAttention` -> `MLP` -> `Block` -> `Transformer` (`gpt`), its
building blocks (`layers`, `masks`) and the generation cache (`kv_cache`)."""
