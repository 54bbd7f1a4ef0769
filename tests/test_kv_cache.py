"""Tests of the generation cache: cached decoding equals the full forward, with padding too."""

from __future__ import annotations

import pytest
import torch
from model_helpers import assert_close, context, gen, randomize_, tiny_model, with_weights

from llmcli.errors import InputError
from llmcli.model.gpt import MultiHeadAttention
from llmcli.model.kv_cache import KVCache

MODEL_OPTIONS = {
    "default": {},
    "all-options": {
        "pos_emb": "rope",
        "norm": "rmsnorm",
        "qk_norm": True,
        "mlp": "relu2",
        "tie_embeddings": False,
    },
}


@pytest.mark.parametrize("opts", MODEL_OPTIONS.values(), ids=MODEL_OPTIONS.keys())
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


@pytest.mark.parametrize("opts", MODEL_OPTIONS.values(), ids=MODEL_OPTIONS.keys())
def test_kv_cache_left_padded_batch_equals_each_prompt_alone(opts):
    model = tiny_model(**opts)
    prompts = [torch.randint(37, (n,), generator=gen(n)) for n in (3, 7, 5)]
    continuation = torch.randint(37, (3, 6), generator=gen(9))
    width = max(len(p) for p in prompts)
    idx = torch.zeros(3, width, dtype=torch.long)
    kpm = torch.ones(3, width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        idx[i, width - len(p) :] = p
        kpm[i, width - len(p) :] = False
    tag = ",".join(opts) or "default"
    for explicit_positions in (False, True):
        cache = model.new_kv_cache(3)
        if explicit_positions:
            pos = ((~kpm).cumsum(1) - 1).clamp(min=0)
            prefill, _ = model(idx, key_padding_mask=kpm, position_ids=pos, kv_cache=cache)
        else:
            prefill, _ = model(idx, key_padding_mask=kpm, kv_cache=cache)
        steps = []
        for t in range(continuation.shape[1]):
            pos = None
            if explicit_positions:
                pos = torch.tensor([[len(p) + t] for p in prompts])
            logits, _ = model(continuation[:, t : t + 1], position_ids=pos, kv_cache=cache)
            steps.append(logits)
        steps = torch.cat(steps, dim=1)  # (3, 6, V)
        for i, p in enumerate(prompts):
            alone, _ = model(torch.cat([p, continuation[i]])[None])
            name = f"left-padded cached vs alone, prompt {i} [{tag}, pos={explicit_positions}]"
            assert_close(torch.cat([prefill[i, width - len(p) :], steps[i]]), alone[0], name)
    # And equals the full padded forward without cache.
    full, _ = model(
        torch.cat([idx, continuation], 1),
        key_padding_mask=torch.cat([kpm, torch.zeros(3, 6, dtype=torch.bool)], 1),
    )
    real = torch.cat([~kpm, torch.ones(3, 6, dtype=torch.bool)], 1)
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
    assert isinstance(cache, KVCache) and cache.k.shape == (2, 1, 4, 8, 8)


def test_mha_standalone_kv_cache():
    mha = randomize_(MultiHeadAttention(n_head=4, n_embed=32, context_length=8, pos_emb="rope"))
    mha.eval()
    x = torch.randn(2, 8, 32, generator=gen(1))
    cache = KVCache(1, 2, 4, 8, 8)
    parts = [
        mha(x[:, :3], context(mha, x[:, :3], kv_cache=cache)),
        mha(x[:, 3:4], context(mha, x[:, 3:4], kv_cache=cache)),
        mha(x[:, 4:], context(mha, x[:, 4:], kv_cache=cache)),
    ]
    assert_close(torch.cat(parts, 1), mha(x), "standalone mha kv cache")
    cache.reset()
    y, w = with_weights(mha, x[:, :5], context(mha, x[:, :5], kv_cache=cache))
    y2, w2 = with_weights(mha, x[:, 5:], context(mha, x[:, 5:], kv_cache=cache))
    assert w2.shape == (2, 4, 3, 8)
    assert_close(w2, with_weights(mha, x)[1][:, :, 5:], "cached explicit weights")
