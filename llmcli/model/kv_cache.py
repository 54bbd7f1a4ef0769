"""The generation cache.

`Transformer.new_kv_cache` makes a `KVCache`; `Transformer.forward(..., kv_cache=...)` appends
the new tokens' keys/values and attends over everything cached, so feeding one token per step
gives the same logits as recomputing the whole sequence. The cache also keeps the key padding
mask of a left-padded batch (`llmcli.model.attention.padding_with_cache`), so decode steps need
not pass it again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from llmcli.errors import InputError

Views = tuple[Tensor, Tensor]  # a layer's keys and values at some positions
MAX_KEPT_VIEWS = 16_384  # tensor views a cache keeps for steps that come back (see _views)


class KVCache:
    """Keys and values of every attention layer, preallocated for `max_len` positions.

    `MultiHeadAttention` writes the new tokens' keys/values for its layer at the layer's current
    length and attends over everything cached up to there. After a full `Transformer.forward`
    every layer holds the same number of positions, `length`.

    The cache also remembers the key padding mask it was given (see `Transformer.forward`), so a
    left-padded batch is prefilled once with its mask and then decoded without passing it again.

    Cached states depend on absolute positions (and, past the first layer, on every earlier
    token), so generation beyond `max_len` cannot just drop the oldest entry: `reset()` and
    prefill the last window again (or `crop(n)` to go back to a shared prefix).

    Without autograd (generation), the views a step writes and reads are kept for the steps
    that come back to the same positions (see `_views`): at most `MAX_KEPT_VIEWS` tensor views
    (a few hundred bytes each, a few MB in all), not copies of the keys and values.

    Attributes:
        k, v: `(n_layer, B, nh, max_len, hs)`.
        padding: `(B, max_len)` bool, True = padding; meaningful where `has_padding`.
        max_len: positions the cache can hold.
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
        # One view per layer, made once: a step then writes and reads without indexing `k`/`v`.
        # (select, not unbind: autograd forbids in-place writes to views of unbind's outputs)
        self._k_layers = [self.k[i] for i in range(n_layer)]
        self._v_layers = [self.v[i] for i in range(n_layer)]
        self.padding = torch.zeros(batch_size, max_len, device=device, dtype=torch.bool)
        self.has_padding = False
        self.n_layer = n_layer
        self.batch_size = batch_size
        self.max_len = max_len
        self._lengths = [0] * n_layer  # Python ints: no host-device sync to read them
        self._kept: dict[tuple[int, int], tuple[tuple[Tensor, ...], ...]] = {}  # see _views
        self._max_kept = MAX_KEPT_VIEWS // (4 * n_layer)  # entries hold 4 views per layer

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        batch_size: int,
        max_len: int | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """An empty cache for a `Transformer` (default: `context_length` positions, the model's
        device and dtype)."""
        max_len = model.context_length if max_len is None else max_len
        if not 0 < max_len <= model.context_length:
            raise InputError(
                f"KV cache max_len must be in 1..context_length ({model.context_length}), "
                f"got {max_len}"
            )
        weight = model.wte.weight
        return cls(
            model.n_layer,
            batch_size,
            model.n_head,
            model.n_embed // model.n_head,
            max_len,
            device=weight.device if device is None else device,
            dtype=weight.dtype if dtype is None else dtype,
        )

    @property
    def length(self) -> int:
        """Number of positions cached (by the first layer; all layers agree after a forward)."""
        return self._lengths[0]

    def layer_length(self, layer_idx: int) -> int:
        """Number of positions cached for one layer."""
        return self._lengths[layer_idx]

    def check_fits(self, batch_size: int, T: int) -> None:
        """Raise `InputError` unless `T` new positions of a batch of `batch_size` fit."""
        if self.batch_size != batch_size:
            raise InputError(f"KV cache is for batch size {self.batch_size}, got {batch_size}")
        if self.length + T > self.max_len:
            raise InputError(
                f"the KV cache holds max_len = {self.max_len} positions; {self.length} are "
                f"cached and {T} more do not fit: reset() or crop() the cache"
            )

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append one layer's new keys/values and return all of that layer's cached ones.

        Args:
            layer_idx: which layer.
            k, v: `(B, nh, T, hs)` for the T new positions.

        Returns:
            `(k_all, v_all)`, each `(B, nh, past + T, hs)` (views into the cache).
        """
        past, T = self._lengths[layer_idx], k.shape[-2]
        if past + T > self.max_len:
            raise InputError(
                f"the KV cache holds max_len = {self.max_len} positions; {past} are cached and "
                f"{T} more do not fit: reset() or crop() the cache, or make a larger one"
            )
        (k_new, v_new), (k_all, v_all) = self._views(layer_idx, past, T)
        k_new.copy_(k)
        v_new.copy_(v)
        self._lengths[layer_idx] = past + T
        return k_all, v_all  # each (B, nh, past + T, hs)

    def _views(self, layer_idx: int, past: int, T: int) -> tuple[Views, Views]:
        """One layer's views `(B, nh, ., hs)` of the keys and values at the new positions
        `past .. past + T - 1`, and at every position up to them.

        Without autograd every layer's views of a step are made at once (the layers of a forward
        write the same positions, and one `unbind` is cheaper than a view per layer) and kept,
        for the steps that come back to the same positions (after a `reset`, a `shift` past the
        context): on a small model, making views was most of the cache's cost per step. Under
        autograd each layer makes its own, as writing to `unbind`'s views is refused there.
        """
        if torch.is_grad_enabled():
            k, v = self._k_layers[layer_idx], self._v_layers[layer_idx]
            new = k.narrow(2, past, T), v.narrow(2, past, T)
            return new, (k.narrow(2, 0, past + T), v.narrow(2, 0, past + T))
        views = self._kept.get((past, T))
        if views is None:
            views = tuple(
                x.narrow(3, start, length).unbind(0)  # n_layer views (B, nh, length, hs)
                for start, length in ((past, T), (0, past + T))
                for x in (self.k, self.v)
            )
            # Steps come back to one-token steps and prefills; other shapes rarely repeat.
            if (T == 1 or past == 0) and len(self._kept) < self._max_kept:
                self._kept[(past, T)] = views
        k_new, v_new, k_all, v_all = views
        return (k_new[layer_idx], v_new[layer_idx]), (k_all[layer_idx], v_all[layer_idx])

    def reset(self) -> None:
        """Forget everything cached (the memory is kept for reuse)."""
        self._lengths = [0] * self.n_layer
        self.has_padding = False

    def crop(self, n: int) -> None:
        """Keep only the first `n` positions (no-op where fewer are cached)."""
        if n < 0:
            raise InputError(f"crop length must be >= 0, got {n}")
        self._lengths = [min(length, n) for length in self._lengths]

    @contextmanager
    def unchanged_on_error(self) -> Iterator[None]:
        """Leave the cache as it was if the block raises (a hook function that fails, Ctrl-C in
        the middle of the layers): some layers would hold the new positions and others not."""
        lengths, has_padding = list(self._lengths), self.has_padding
        try:
            yield
        except BaseException:
            self._lengths, self.has_padding = lengths, has_padding
            raise
