"""Attention inspection: capture every head's weights, score the heads, dump, draw and view them.

The modules import one way: `metrics` (pure NumPy) and `dump` (the file format) at the bottom,
then `capture`, `pictures` and `viewer`, and `report` (the `inspect-attention` command's library
function) on top. This file imports none of them, so `metrics` loads without torch.
"""
