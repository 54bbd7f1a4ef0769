"""A fused attention layer and the separate heads it computes, converted both ways.

`MultiHeadAttention` computes `n_head` `Head`s at once through one QKV projection; these copy the
weights between the two forms, so that a test (and a learner) can check that the fused layer is
`proj(cat([head(x) for head in heads], dim=-1))`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from llmcli.errors import InputError
from llmcli.model.gpt import Head, MultiHeadAttention


def fuse_heads(heads: list[Head], proj: nn.Linear) -> MultiHeadAttention:
    """Build the fused layer from a list of `Head`s and an output projection (weights copied).

    A missing bias on the heads or on `proj` becomes a zero bias, which computes the same.
    """
    if not heads:
        raise InputError("fuse_heads needs at least one Head")
    n_head = len(heads)
    n_embed, head_size = heads[0].key.in_features, heads[0].key.out_features
    if n_head * head_size != n_embed or proj.in_features != n_embed:
        raise InputError(
            f"fuse_heads needs n_head * head_size == n_embed == proj.in_features, got "
            f"{n_head} * {head_size}, {n_embed}, {proj.in_features}"
        )
    bias = heads[0].config.bias or proj.bias is not None
    config = dataclasses.replace(heads[0].config, n_head=n_head, bias=bias)
    mha = MultiHeadAttention(config).to(device=proj.weight.device, dtype=proj.weight.dtype)
    with torch.no_grad():
        for i, head in enumerate(heads):
            rows = slice(i * head_size, (i + 1) * head_size)
            for j, linear in enumerate((head.query, head.key, head.value)):
                qkv_rows = slice(j * n_embed + rows.start, j * n_embed + rows.stop)
                mha.qkv.weight[qkv_rows] = linear.weight
                if mha.qkv.bias is not None:
                    mha.qkv.bias[qkv_rows] = linear.bias if linear.bias is not None else 0.0
        mha.proj.weight.copy_(proj.weight)
        if mha.proj.bias is not None:
            mha.proj.bias.copy_(proj.bias if proj.bias is not None else 0.0)
    return mha


def split_heads(mha: MultiHeadAttention) -> list[Head]:
    """This layer as `n_head` separate `Head` modules, holding copies of its weights.

    `mha.proj(torch.cat([h(x) for h in split_heads(mha)], dim=-1))` equals `mha(x)`.
    """
    C, hs = mha.config.n_embed, mha.head_size
    heads = []
    for i in range(mha.n_head):
        head = Head(mha.config).to(device=mha.qkv.weight.device, dtype=mha.qkv.weight.dtype)
        with torch.no_grad():
            for j, linear in enumerate((head.query, head.key, head.value)):
                rows = slice(j * C + i * hs, j * C + (i + 1) * hs)
                linear.weight.copy_(mha.qkv.weight[rows])
                if mha.qkv.bias is not None:
                    linear.bias.copy_(mha.qkv.bias[rows])
        heads.append(head)
    return heads
