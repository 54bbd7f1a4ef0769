"""Sampling speed: KV-cached decoding against full recomputation and `transformers`; prints JSON.

1. `cached_vs_recompute`: new tokens/s for 500 tokens at batch 1 (greedy, 1-token prompt) with
   llmcli's `generate` (KV cache) and with the nanoGPT loop (crop to the context, rerun the whole
   sequence, take the last logits, append), on the tiny model (4 layers, n_embed 128, context 64)
   and a context-512 model (6 layers, 6 heads, n_embed 384). Past the tiny model's context both
   recompute the 64-token window every step (positions are absolute, so a sliding window
   invalidates every cached key): its ratio covers only the first 64 tokens' savings.
2. `latency`: per-token latency of the first and the last 100 tokens of a 1,000-token generation
   with the cache, on the 6-layer model with context 1024 (so the cache stays valid throughout).
3. `vs_transformers`: the context-512 model's weights in `transformers`' GPT2LMHeadModel,
   `generate(do_sample=False, use_cache=True)` for 500 tokens, against llmcli's `generate`,
   interleaved rounds, median tokens/s; `tokens_equal` says whether both produced the same ids.
4. `batched_vs_sequential`: 16 prompts of different lengths (8..128 tokens, 100 new tokens each
   on the context-512 model; 4..36 tokens, 24 new on the tiny one), temperature 0.8, top-k 50,
   one seed per prompt, as one left-padded batch against one prompt after another;
   `same_tokens` checks that every prompt got the same tokens both ways.

Weights are random (speed does not depend on them), scaled up so that logits are not near-ties.
Usage: python benchmarks/sample_throughput.py [--threads N] [--new-tokens 500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmcli.config import ModelConfig  # noqa: E402
from llmcli.generate import generate  # noqa: E402
from llmcli.model import Transformer  # noqa: E402

VOCAB = 65  # the bundled corpus' characters
TINY = dict(n_layer=4, n_head=4, n_embed=128, context_length=64)
MID = dict(n_layer=6, n_head=6, n_embed=384, context_length=512)


def make_model(shape: dict, seed: int = 0) -> Transformer:
    g = torch.Generator().manual_seed(seed)
    model = Transformer(VOCAB, **shape, generator=g)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    return model.eval()


def llmcli_tokens(model: Transformer, prompt: list[int], n: int, **kw) -> tuple[list[int], float]:
    """Greedy (unless kw says otherwise) generation with llmcli; (new ids, seconds)."""
    kw = {"temperature": 0.0, **kw}
    start = time.perf_counter()
    out = [step for step in generate(model, [prompt], n, **kw)]
    seconds = time.perf_counter() - start
    return torch.cat(out).tolist(), seconds


@torch.no_grad()
def nanogpt_tokens(model: Transformer, prompt: list[int], n: int) -> tuple[list[int], float]:
    """nanoGPT's `generate`: crop to the context, rerun everything, greedy on the last logits."""
    idx = torch.tensor([prompt])
    start = time.perf_counter()
    for _ in range(n):
        idx_cond = idx[:, -model.context_length :]
        logits, _ = model(idx_cond)
        next_id = logits[:, -1, :].argmax(dim=-1, keepdim=True)  # (1, 1)
        idx = torch.cat((idx, next_id), dim=1)
    seconds = time.perf_counter() - start
    return idx[0, len(prompt) :].tolist(), seconds


def cached_vs_recompute(n: int) -> dict:
    out = {}
    for name, shape in (("tiny_ctx64", TINY), ("6L_384_ctx512", MID)):
        model = make_model(shape)
        llmcli_tokens(model, [1], 8)  # warm-up
        cached_ids, cached_s = llmcli_tokens(model, [1], n)
        full_ids, full_s = nanogpt_tokens(model, [1], n)
        out[name] = {
            "shape": shape,
            "new_tokens": n,
            "cached_tokens_per_s": round(n / cached_s, 1),
            "full_recompute_tokens_per_s": round(n / full_s, 1),
            "speedup": round(full_s / cached_s, 2),
            "tokens_equal": cached_ids == full_ids,
        }
    return out


def latency(n: int = 1000, window: int = 100) -> dict:
    shape = {**MID, "context_length": 1024}
    model = make_model(shape)
    llmcli_tokens(model, [1], 8)
    stamps = [time.perf_counter()]
    for _ in generate(model, [[1]], n, temperature=0.0):
        stamps.append(time.perf_counter())
    per_token = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    first = statistics.mean(per_token[:window]) * 1e3
    last = statistics.mean(per_token[-window:]) * 1e3
    return {
        "shape": shape,
        "new_tokens": n,
        "first_100_ms_per_token": round(first, 2),
        "last_100_ms_per_token": round(last, 2),
        "last_over_first": round(last / first, 2),
    }


def to_transformers(model: Transformer, shape: dict):
    from transformers import GPT2Config, GPT2LMHeadModel

    from llmcli.hf.gpt2 import hf_config as gpt2_config
    from llmcli.hf.gpt2 import to_hf as to_gpt2_state_dict

    cfg = gpt2_config(ModelConfig(**shape), VOCAB, None)
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf = GPT2LMHeadModel(GPT2Config(**cfg, attn_implementation="sdpa"))
    missing, unexpected = hf.load_state_dict(to_gpt2_state_dict(model), strict=False)
    assert not unexpected and all("lm_head" in m or "attn.bias" in m for m in missing), missing
    hf.tie_weights()
    return hf.eval()


def vs_transformers(n: int, rounds: int) -> dict:
    model = make_model(MID)
    hf = to_transformers(model, MID)
    prompt = torch.tensor([[1]])
    kwargs = dict(
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
        eos_token_id=None,
    )

    def run_hf() -> tuple[list[int], float]:
        start = time.perf_counter()
        with torch.inference_mode():
            ids = hf.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
        return ids[0, 1:].tolist(), time.perf_counter() - start

    run_hf()  # warm-up (both)
    llmcli_tokens(model, [1], 8)
    ours_s, theirs_s = [], []
    for _ in range(rounds):
        ours_ids, s = llmcli_tokens(model, [1], n)
        ours_s.append(s)
        hf_ids, s = run_hf()
        theirs_s.append(s)
    same_prefix = next(
        (i for i, (a, b) in enumerate(zip(ours_ids, hf_ids, strict=True)) if a != b), n
    )
    ours, theirs = statistics.median(ours_s), statistics.median(theirs_s)
    return {
        "shape": MID,
        "new_tokens": n,
        "rounds": rounds,
        "llmcli_tokens_per_s": round(n / ours, 1),
        "transformers_tokens_per_s": round(n / theirs, 1),
        "speedup": round(theirs / ours, 2),
        "tokens_equal": ours_ids == hf_ids,
        "equal_prefix_tokens": same_prefix,
    }


def batched_vs_sequential(shape: dict, lengths: list[int], n: int) -> dict:
    model = make_model(shape)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (L,), generator=g).tolist() for L in lengths]
    kw = dict(temperature=0.8, top_k=50)
    llmcli_tokens(model, prompts[0], 8, **kw, seed=0)

    start = time.perf_counter()
    steps = [step for step in generate(model, prompts, n, seed=0, **kw)]
    batched_s = time.perf_counter() - start
    batched = torch.stack(steps, dim=1).tolist()  # (len(prompts), n)

    start = time.perf_counter()
    alone = [llmcli_tokens(model, p, n, seed=i, **kw)[0] for i, p in enumerate(prompts)]
    sequential_s = time.perf_counter() - start
    total = n * len(prompts)
    return {
        "shape": shape,
        "prompts": len(prompts),
        "prompt_lengths": [min(lengths), max(lengths)],
        "new_tokens_each": n,
        "batched_tokens_per_s": round(total / batched_s, 1),
        "sequential_tokens_per_s": round(total / sequential_s, 1),
        "speedup": round(sequential_s / batched_s, 2),
        "same_tokens": batched == alone,
    }


def spread(lo: int, hi: int, n: int = 16) -> list[int]:
    return [lo + ((hi - lo) * i) // (n - 1) for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's own choice)"
    )
    parser.add_argument("--new-tokens", type=int, default=500)
    parser.add_argument("--latency-tokens", type=int, default=1000)
    parser.add_argument("--batch-tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="rounds against transformers")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    started = time.perf_counter()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()
    parts = {
        "cached_vs_recompute": cached_vs_recompute(args.new_tokens),
        "latency": latency(args.latency_tokens),
        "vs_transformers": vs_transformers(args.new_tokens, args.rounds),
        "batched_vs_sequential": {
            "6L_384_ctx512": batched_vs_sequential(MID, spread(8, 128), args.batch_tokens),
            # Prompts and new tokens stay within the tiny model's 64-token context.
            "tiny_ctx64": batched_vs_sequential(TINY, spread(4, 36), 24),
        },
    }
    cvr, bvs = parts["cached_vs_recompute"], parts["batched_vs_sequential"]
    result = {
        "ratios": {
            "cached_over_recompute_ctx512": cvr["6L_384_ctx512"]["speedup"],
            "cached_over_recompute_tiny_ctx64": cvr["tiny_ctx64"]["speedup"],
            "llmcli_over_transformers_ctx512": parts["vs_transformers"]["speedup"],
            "batched_over_sequential_ctx512": bvs["6L_384_ctx512"]["speedup"],
            "batched_over_sequential_tiny": bvs["tiny_ctx64"]["speedup"],
            "latency_last_over_first": parts["latency"]["last_over_first"],
        },
        "targets": {
            "cached_over_recompute_ctx512": ">= 10",
            "llmcli_over_transformers_ctx512": ">= 1.5",
            "batched_over_sequential": ">= 5",
        },
        **parts,
        "machine": {
            "date": date,
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_at_start": [round(x, 2) for x in load],
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
