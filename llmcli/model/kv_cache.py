"""The generation cache: every attention layer's keys and values of the positions seen so far.

`Transformer.new_kv_cache` makes a `KVCache`; `Transformer.forward(..., kv_cache=cache)` has each
layer write its new tokens' keys and values after the `length` cached ones (`update`) and attend
over all of them, then counts the new positions (`advance`), so feeding one token per step gives
the same logits as recomputing the whole sequence. A forward that fails half-way (a hook function
that raises, Ctrl-C) leaves `length` as it was: the keys some layers wrote past it are
overwritten next time.

Cached keys depend on absolute positions (and, past the first layer, on every earlier token), so
generation beyond `max_len` cannot just drop the oldest entry: `reset()` and prefill the last
window again (or `crop(n)` to go back to a shared prefix); what to keep past the context is
`llmcli.generation.engine`'s. Rows that share a prompt can share its prefill: fill a cache of one
row per distinct prompt, then `copy_rows` it into the batch's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmcli.errors import InputError


class KVCache:
    """Keys and values of every attention layer, preallocated for `max_len` positions.

    Attributes:
        k, v: `(n_layer, B, nh, max_len, hs)`.
        length: positions cached, the same in every layer.
        batch_size, max_len: the rows and positions the cache holds.
    """

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_head: int,
        head_size: int,
        max_len: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        shape = (n_layer, batch_size, n_head, max_len, head_size)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0

    def check_room(self, batch_size: int, T: int) -> None:
        """Raise `InputError` unless `T` new positions of a batch of `batch_size` fit."""
        if self.batch_size != batch_size:
            raise InputError(f"KV cache is for batch size {self.batch_size}, got {batch_size}")
        if self.length + T > self.max_len:
            raise InputError(
                f"the KV cache holds max_len = {self.max_len} positions; {self.length} are "
                f"cached and {T} more do not fit: reset() or crop() the cache"
            )

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write one layer's keys and values of the new positions after the cached ones.

        Args:
            layer_idx: which layer.
            k, v: `(B, nh, T, hs)` for the T new positions.

        Returns:
            `(k_all, v_all)`, each `(B, nh, length + T, hs)`: views of every position of the
            layer up to the new ones.
        """
        end = self.length + k.shape[2]
        k_layer, v_layer = self.k[layer_idx], self.v[layer_idx]  # each (B, nh, max_len, hs)
        k_layer[:, :, self.length : end] = k
        v_layer[:, :, self.length : end] = v
        return k_layer[:, :, :end], v_layer[:, :, :end]

    def advance(self, T: int) -> None:
        """Count `T` new positions, once every layer has written them (`update`)."""
        self.length += T

    def reset(self) -> None:
        """Forget everything cached (the memory is kept for reuse)."""
        self.length = 0

    def crop(self, n: int) -> None:
        """Keep only the first `n` positions (no-op where fewer are cached)."""
        if n < 0:
            raise InputError(f"crop length must be >= 0, got {n}")
        self.length = min(self.length, n)

    def copy_rows(self, source: KVCache, rows: Tensor) -> None:
        """Hold what `source` holds, row `b` taken from its row `rows[b]`, in place of what was
        cached (a prefill run once per distinct prompt, copied to every row of that prompt).

        Args:
            source: a cache of the same layers and heads, at most `max_len` positions cached.
            rows: `(batch_size,)` long, indices of `source`'s rows.
        """
        T = source.length
        self.reset()
        self.check_room(rows.shape[0], T)
        self.k[:, :, :, :T] = source.k[:, rows, :, :T]  # (n_layer, B, nh, T, hs)
        self.v[:, :, :, :T] = source.v[:, rows, :, :T]
        self.length = T
