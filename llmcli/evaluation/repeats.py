"""Where the tokens of a sequence repeat: what induction and duplicate-token scores are measured on.

Pure NumPy, so that the attention metrics that use it load without torch.
"""

from __future__ import annotations

import numpy as np


def earlier_occurrences(ids: np.ndarray) -> np.ndarray:
    """Where each token occurred before: `[T, T]` bool, True at (q, k) for k < q, ids[k] == ids[q].

    Args:
        ids: token ids `[T]`.
    """
    ids = np.asarray(ids).reshape(-1)
    T = len(ids)
    return (ids[:, None] == ids[None, :]) & np.tri(T, T, -1, dtype=bool)  # (T, T)
