"""Left padding for a batch of prompts of different lengths: the attention mask and the positions
a forward over the padded rows takes.

Row `b` starts with `pads[b]` padding columns, then its tokens; all rows end at the same column,
so every row's next token comes from the last column. The model itself knows nothing of padding:
these build what its forward takes (`mask`, `input_pos`), so that each row computes exactly what
it would compute alone:

- no token attends to a padding key;
- positions count real tokens only: a row's first real token is at position 0, as if alone;
- a padding query, which has no real key at or before it, attends to itself alone, so that no
  softmax row is empty (its output is never read, and no real token attends to it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmcli.model.gpt import causal_mask


def padded_mask(pads: Tensor, T: int, T_k: int) -> Tensor:
    """The attention mask of `T` new columns after `T_k - T` earlier ones, in left-padded rows.

    Args:
        pads: `(B,)` long, each row's padding columns (counted from column 0 of the keys).
        T, T_k: new columns (queries) and all columns (keys).

    Returns:
        `(B, 1, T, T_k)` bool, True = may attend: causal, no padding key, a padding query on
        itself.
    """
    cols = torch.arange(T_k, device=pads.device)  # (T_k,)
    real_keys = cols[None, :] >= pads[:, None]  # (B, T_k)
    causal = causal_mask(T, T_k, pads.device)  # (T, T_k)
    itself = cols[None, :] == cols[T_k - T :, None]  # (T, T_k): each query's own column
    mask = causal & real_keys[:, None, :] | itself  # (B, T, T_k)
    return mask[:, None]  # (B, 1, T, T_k)


def padded_positions(pads: Tensor, T: int, T_k: int) -> Tensor:
    """`(B, T)` long positions of the last `T` of `T_k` columns: the real tokens before each one
    (padding columns get 0)."""
    cols = torch.arange(T_k - T, T_k, device=pads.device)  # (T,)
    return (cols[None, :] - pads[:, None]).clamp(min=0)  # (B, T)
