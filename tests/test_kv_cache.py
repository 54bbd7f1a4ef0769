"""Tests of the generation cache (llmcli/model/kv_cache.py): cached decoding equals the full
forward, with left padding too (the mask and positions of `llmcli.generation.engine`, and the
same built by hand), and the cache's own bookkeeping (rows copied from a shared prefill too)."""

from __future__ import annotations

import pytest
import torch
from model_helpers import (
    RECIPE_OPTIONS,
    assert_close,
    gen,
    left_padded,
    randomize_,
    tiny_model,
    with_weights,
)

from llmcli.errors import InputError
from llmcli.generation.engine import padded_mask, padded_positions
from llmcli.model.gpt import MultiHeadAttention
from llmcli.model.kv_cache import KVCache


@pytest.mark.parametrize("opts", RECIPE_OPTIONS.values(), ids=RECIPE_OPTIONS.keys())
def test_kv_cache_decode_and_chunked_prefill_equal_full_forward(opts):
    model = tiny_model(**opts)
    idx = torch.randint(37, (2, 16), generator=gen(1))
    full, _ = model(idx)
    tag = ",".join(opts) or "default"
    for chunks in ([1] * 16, [5, 4, 1, 6]):
        cache = model.new_kv_cache(2)
        outs, start = [], 0
        for n in chunks:
            logits, _ = model(idx[:, start : start + n], kv_cache=cache)
            outs.append(logits)
            start += n
        assert cache.length == 16
        assert_close(
            torch.cat(outs, dim=1),
            full,
            f"kv cache chunks {chunks[:4]} [{tag}]",
            atol=1e-5,
            rtol=1e-5,
        )
    # crop and recompute the tail
    cache.crop(10)
    logits, _ = model(idx[:, 10:], kv_cache=cache)
    assert_close(logits, full[:, 10:], f"kv cache after crop [{tag}]")
    cache.reset()
    logits, _ = model(idx[:, :3], kv_cache=cache)
    assert_close(logits, full[:, :3], f"kv cache after reset [{tag}]")


def hand_mask(pads: torch.Tensor, T: int, T_k: int) -> torch.Tensor:
    """`padded_mask` built another way: a key padding mask (True = padding) combined with the
    causal one, padding queries opened on their own column. `(B, 1, T, T_k)`."""
    pad = torch.arange(T_k)[None, :] < pads[:, None]  # (B, T_k)
    causal = torch.ones(T, T_k, dtype=torch.bool).tril(T_k - T)  # (T, T_k)
    own = torch.zeros(T, T_k, dtype=torch.bool)
    own[:, T_k - T :] = torch.eye(T, dtype=torch.bool)
    return (causal & ~pad[:, None, :] | own)[:, None]


@pytest.mark.parametrize("opts", RECIPE_OPTIONS.values(), ids=RECIPE_OPTIONS.keys())
def test_kv_cache_left_padded_batch_equals_each_prompt_alone(opts):
    model = tiny_model(**opts)
    prompts = [torch.randint(37, (n,), generator=gen(n)) for n in (3, 7, 5)]
    continuation = torch.randint(37, (3, 6), generator=gen(9))
    idx, pads = left_padded(prompts)
    W = idx.shape[1]
    tag = ",".join(opts) or "default"
    for by_hand in (False, True):
        # The mask and positions from llmcli.generation.engine, or built here by hand (the
        # positions: real tokens before each, as `(~pad).cumsum - 1`, then the prompt length on).
        make_mask = hand_mask if by_hand else padded_mask
        cache = model.new_kv_cache(3)
        if by_hand:
            real = torch.arange(W)[None, :] >= pads[:, None]  # (B, W)
            pos = (real.cumsum(1) - 1).clamp(min=0)
        else:
            pos = padded_positions(pads, W, W)
        prefill, _ = model(idx, mask=make_mask(pads, W, W), input_pos=pos, kv_cache=cache)
        steps = []
        for t in range(continuation.shape[1]):
            T_k = W + t + 1
            if by_hand:
                pos = torch.tensor([[len(p) + t] for p in prompts])
            else:
                pos = padded_positions(pads, 1, T_k)
            mask = make_mask(pads, 1, T_k)
            logits, _ = model(continuation[:, t : t + 1], mask=mask, input_pos=pos, kv_cache=cache)
            steps.append(logits)
        assert cache.length == W + 6
        steps = torch.cat(steps, dim=1)  # (3, 6, V)
        for i, p in enumerate(prompts):
            alone, _ = model(torch.cat([p, continuation[i]])[None])
            name = f"left-padded cached vs alone, prompt {i} [{tag}, by_hand={by_hand}]"
            assert_close(torch.cat([prefill[i, W - len(p) :], steps[i]]), alone[0], name)
    # And equals the full padded forward without cache.
    full_idx = torch.cat([idx, continuation], 1)
    T = W + 6
    full, _ = model(full_idx, mask=padded_mask(pads, T, T), input_pos=padded_positions(pads, T, T))
    real = torch.arange(T)[None, :] >= pads[:, None]  # (B, T)
    cached = torch.cat([prefill, steps], dim=1)
    assert_close(cached[real], full[real], f"cached vs full padded forward [{tag}]")


def test_kv_cache_errors():
    model = tiny_model()
    with pytest.raises(InputError, match="max_len"):
        model.new_kv_cache(1, max_len=17)
    cache = model.new_kv_cache(1, max_len=8)
    model(torch.zeros(1, 6, dtype=torch.long), kv_cache=cache)
    with pytest.raises(InputError, match="max_len = 8"):
        model(torch.zeros(1, 3, dtype=torch.long), kv_cache=cache)
    with pytest.raises(InputError, match="batch size"):
        model(torch.zeros(2, 1, dtype=torch.long), kv_cache=cache)
    assert cache.length == 6  # failed calls left the cache as it was
    assert isinstance(cache, KVCache) and cache.k.shape == cache.v.shape == (2, 1, 4, 8, 8)
    assert (cache.batch_size, cache.max_len) == (1, 8)
    with pytest.raises(InputError, match="crop length"):
        cache.crop(-1)
    cache.crop(9)  # more than is cached: no-op
    assert cache.length == 6


def test_update_writes_after_the_cached_positions_and_returns_them_all():
    cache = KVCache(2, 1, 2, 3, 5)  # 2 layers, B 1, 2 heads, hs 3, 5 positions
    k1, v1 = torch.randn(1, 2, 2, 3, generator=gen(1)), torch.randn(1, 2, 2, 3, generator=gen(2))
    k_all, v_all = cache.update(1, k1, v1)  # nothing cached yet
    assert torch.equal(k_all, k1) and torch.equal(v_all, v1)
    assert cache.length == 0  # the caller (Transformer.forward) counts the positions
    cache.advance(2)
    assert cache.length == 2
    k2, v2 = torch.randn(1, 2, 1, 3, generator=gen(3)), torch.randn(1, 2, 1, 3, generator=gen(4))
    k_all, v_all = cache.update(1, k2, v2)
    assert torch.equal(k_all, torch.cat([k1, k2], 2)) and torch.equal(v_all, torch.cat([v1, v2], 2))
    assert k_all.data_ptr() == cache.k[1].data_ptr()  # views of the cache, no copy
    assert (cache.k[0] == 0).all() and (cache.k[1, :, :, 3:] == 0).all()  # nothing else written


def test_mha_standalone_kv_cache():
    mha = randomize_(MultiHeadAttention(n_head=4, n_embed=32, context_length=8, pos_emb="rope"))
    mha.eval()
    x = torch.randn(2, 8, 32, generator=gen(1))
    cache = KVCache(1, 2, 4, 8, 8)
    parts = []
    for start, end in ((0, 3), (3, 4), (4, 8)):
        parts.append(mha(x[:, start:end], kv_cache=cache))
        cache.advance(end - start)  # a layer alone: the caller counts, as Transformer does
    assert_close(torch.cat(parts, 1), mha(x), "standalone mha kv cache")
    cache.reset()
    with_weights(mha, x[:, :5], kv_cache=cache)
    cache.advance(5)
    y2, w2 = with_weights(mha, x[:, 5:], kv_cache=cache)
    assert w2.shape == (2, 4, 3, 8)
    assert_close(w2, with_weights(mha, x)[1][:, :, 5:], "cached explicit weights")


def test_copy_rows_gives_each_row_the_source_row_it_names_in_place_of_its_own():
    source = KVCache(2, 2, 2, 3, 4)  # 2 layers, B 2, 2 heads, hs 3, 4 positions
    source.k.copy_(torch.randn(source.k.shape, generator=gen(1)))
    source.v.copy_(torch.randn(source.v.shape, generator=gen(2)))
    source.advance(3)
    cache = KVCache(2, 3, 2, 3, 5)
    cache.advance(5)  # full: copy_rows replaces what it held
    rows = [1, 0, 1]
    cache.copy_rows(source, torch.tensor(rows))
    assert cache.length == 3
    for b, s in enumerate(rows):
        assert torch.equal(cache.k[:, b, :, :3], source.k[:, s, :, :3])
        assert torch.equal(cache.v[:, b, :, :3], source.v[:, s, :, :3])
    assert not torch.equal(cache.k[:, 0], cache.k[:, 1])  # not all rows from one
    with pytest.raises(InputError, match="batch size 3, got 2"):
        cache.copy_rows(source, torch.tensor([0, 1]))
    with pytest.raises(InputError, match="max_len = 2"):
        KVCache(2, 3, 2, 3, 2).copy_rows(source, torch.tensor(rows))
