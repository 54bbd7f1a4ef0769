"""Sampling speed: context policies, the decode step, `transformers`, padded batches; prints JSON.

Every part runs on random weights (speed does not depend on them), scaled up so that logits are
not near-ties, with llmcli's default sampling (temperature 0.8, top-k 200, seed 1337) unless it
says greedy. Contestants are interleaved round by round in one process, the order rotating, so
that a noisy machine slows them alike; figures are medians over rounds. Each llmcli run uses the
CPU threads `llmcli sample` would (`llmcli.generation.threads.threads_for`: 1 for the tiny model's
decode-bound runs, torch's own count otherwise); the others use torch's own count. The current
llmcli contestants generate as `llmcli sample` does, `generate(model, prompts, config,
decode=FastDecoder.for_model(model))` (`llmcli.generation.fast_decode`: the cached one-token
steps as plain functions of the weights, with ATen's GELU for small steps on the CPU, chosen in
the step itself: no process-wide switch), so the others (the baseline revision, nanoGPT's loop,
`transformers`) run as they are beside them.

1. `long_generation`: batch 1 from a 1-token prompt far past the context: the tiny model
   (4L/128, context 64) for 2,000 tokens and 6L/384 at context 256 for 1,000 tokens. Contestants:
   `shift` (keep context // 2, re-prefill, decode with the cache), `exact` (the last
   context_length tokens recomputed each step past the context), `full_recompute` (the plain
   loop, `llmcli.generation.loop.generate`, one token a call: no cache, the whole window every
   step, the nanoGPT way), `nanogpt` (tiny
   only: nanoGPT's loop, crop / forward / sample / cat, drawing with llmcli's sampler so that
   tokens compare) and `today` (`generate` as it was at the baseline revision, before the context
   policies). Tokens/s, ms per token and per decode step, ratios; `exact`, `full_recompute`,
   `nanogpt` and `today` must give the same tokens.
2. `decode_step`: the tiny model's cached one-token step inside the context (63 new tokens from
   a 1-token prompt), ms per step, today's `generate` (baseline revision) against the current one,
   each at 1 and 2 threads, greedy and sampled; the same tokens are required. The median step,
   and the 10th percentile (less sensitive to other processes on a shared CPU).
3. `vs_transformers_tiny`: the tiny model's weights in `GPT2LMHeadModel`, greedy, 63 tokens
   (inside GPT-2's positions): `generate(use_cache=True)` at 1 and 2 threads (per-step times from
   a streamer) against llmcli's `shift` (equal to `exact` inside the context).
4. The earlier benchmark's 6L/384 figures, for regressions: `mid_ctx512` (500 greedy tokens at
   context 512: current vs today, and nanoGPT's full recompute once), `latency` (first/last 100
   of 1,000 tokens at context 1024), `vs_transformers` (context 512, 500 greedy tokens) and
   `batched_vs_sequential` (16 prompts of different lengths as one padded batch vs one by one).

Usage: python benchmarks/sample_throughput.py [--parts long,decode,...] [--rounds 3]
       [--baseline REV] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from itertools import islice
from pathlib import Path
from typing import NamedTuple

import torch
from git_baseline import load_baseline

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmcli.config import ModelConfig, SampleConfig  # noqa: E402
from llmcli.generation.engine import generate  # noqa: E402
from llmcli.generation.fast_decode import FastDecoder  # noqa: E402
from llmcli.generation.loop import generate as plain_generate  # noqa: E402
from llmcli.generation.sampling import sample_next  # noqa: E402
from llmcli.generation.threads import threads_for, torch_threads  # noqa: E402
from llmcli.model.gpt import Transformer  # noqa: E402

VOCAB = 65  # the bundled corpus' characters
TINY = dict(n_layer=4, n_head=4, n_embed=128, context_length=64)
MID = dict(n_layer=6, n_head=6, n_embed=384, context_length=512)
MID256 = {**MID, "context_length": 256}
SEED = 1337
SAMPLING = dict(temperature=0.8, top_k=200)  # llmcli's sample defaults
BASELINE = "7fa4a5b"  # the last commit before the context policies and the decode step
CPU = torch.device("cpu")
POLICIES = ("shift", "exact")
PARTS = ("long", "decode", "hf_tiny", "mid", "latency", "hf_mid", "batched")


def make_model(shape: dict, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    return _scaled(Transformer(ModelConfig(**shape), VOCAB, generator=g))


def baseline_model(shape: dict, baseline: dict, seed: int = 0) -> torch.nn.Module:
    """`make_model` at the baseline revision, through its own constructor (sizes as arguments):
    the same weights, as the same generator draws them in the same order."""
    g = torch.Generator().manual_seed(seed)
    return _scaled(baseline["model"].Transformer(VOCAB, **shape, generator=g))


def _scaled(model: torch.nn.Module) -> torch.nn.Module:
    """The weight matrices times 4, so that logits are not near-ties; in eval mode."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    return model.eval()


def sample_steps(
    model: torch.nn.Module, prompts: list[list[int]], config: SampleConfig, **kwargs
) -> Iterator[torch.Tensor]:
    """The current llmcli's generation as `llmcli sample` runs it: `generate` with the decoder
    of `llmcli.generation.fast_decode` (built here, at the start of each generation)."""
    return generate(model, prompts, config, decode=FastDecoder.for_model(model), **kwargs)


class Contestant(NamedTuple):
    """One way to generate, for `interleave`.

    Attributes:
        start: starts its step iterator (each step a `(B,)` tensor of new ids).
        threads: the CPU threads it runs on (None: torch's own count).
    """

    start: Callable[[], Iterator[torch.Tensor]]
    threads: int | None = None

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Its threads, while it runs."""
        with torch_threads(self.threads):
            yield


def timed(steps: Iterator[torch.Tensor]) -> tuple[list[int], list[float], float]:
    """Run a step iterator: (row 0's tokens, seconds of each step, total seconds)."""
    start = time.perf_counter()
    stamps, tokens = [start], []
    for step in steps:
        tokens.append(int(step[0]))
        stamps.append(time.perf_counter())
    return tokens, [b - a for a, b in zip(stamps, stamps[1:], strict=False)], stamps[-1] - start


@torch.no_grad()
def nanogpt_steps(model: Transformer, prompt: list[int], n: int, **sampling) -> Iterator:
    """nanoGPT's `generate`: crop to the context, run it all, sample the last logits, append."""
    g = torch.Generator().manual_seed(SEED)  # what llmcli's row 0 draws from
    idx = torch.tensor([prompt])
    for _ in range(n):
        logits, _ = model(idx[:, -model.context_length :])
        next_id = sample_next(logits[:, -1, :], g, **sampling)[:, None]  # (1, 1)
        idx = torch.cat((idx, next_id), dim=1)
        yield next_id[:, 0]


def plain_loop_steps(model: Transformer, prompt: list[int], n: int, **sampling) -> Iterator:
    """llmcli's plain loop (`llmcli.generation.loop.generate`: no cache, the whole window every
    step), one new token a call so that its steps can be timed like the others'."""
    g = torch.Generator().manual_seed(SEED)  # what llmcli's row 0 draws from
    idx = torch.tensor([prompt])  # (1, T)
    for _ in range(n):
        idx = plain_generate(model, idx, 1, g, **sampling)  # (1, T + 1)
        yield idx[:, -1]


def schedule(policy: str, prompt: int, n: int, C: int, keep: int) -> list[str]:
    """What each step of a batch-1 run computes: prefill, decode (one cached token), or
    recompute (`exact` past the context: the whole window, no cache)."""
    kinds, end, cached = [], prompt, False
    for _ in range(n):
        if end > C and policy == "shift":
            end, cached = keep, False
        if policy == "exact" and end > C:
            kinds.append("recompute")
        else:
            kinds.append("decode" if cached else "prefill")
            cached = True
        end += 1
    return kinds


def interleave(contestants: dict[str, Contestant], rounds: int, chunk: int):
    """Run every contestant `rounds` times: name -> list of runs, each (row 0's tokens, seconds
    of each step, total seconds).

    Within a round all contestants run side by side, `chunk` steps each in turn (the order
    rotating), so that a machine whose speed drifts from second to second slows them alike.
    """
    runs: dict[str, list] = {name: [] for name in contestants}
    names = list(contestants)
    for r in range(rounds):
        live = {name: contestants[name].start() for name in names}
        tokens: dict[str, list[int]] = {name: [] for name in names}
        steps: dict[str, list[float]] = {name: [] for name in names}
        turn = r
        while live:
            order = [
                n for n in names[turn % len(names) :] + names[: turn % len(names)] if n in live
            ]
            turn += 1
            for name in order:
                with contestants[name].scope():
                    stamp = time.perf_counter()
                    for _ in range(chunk):
                        step = next(live[name], None)
                        if step is None:
                            del live[name]
                            break
                        tokens[name].append(int(step[0]))
                        now = time.perf_counter()
                        steps[name].append(now - stamp)
                        stamp = now
        for name in names:
            runs[name].append((tokens[name], steps[name], sum(steps[name])))
    return runs


def summarize(runs: list, n: int, kinds: list[str] | None = None) -> dict:
    seconds = statistics.median(total for _, _, total in runs)
    out = {
        "tokens_per_s": round(n / seconds, 1),
        "ms_per_token": round(seconds / n * 1e3, 3),
        "rounds_s": [round(total, 2) for _, _, total in runs],
    }
    if kinds:
        for kind in ("decode", "prefill", "recompute"):
            steps = [s for _, per, _ in runs for s, k in zip(per, kinds, strict=True) if k == kind]
            if steps:
                out[f"ms_per_{kind}_step"] = round(statistics.median(steps) * 1e3, 3)
                out[f"{kind}_steps"] = len(steps) // len(runs)
    return out


def long_generation(shape: dict, n: int, rounds: int, baseline: dict | None, nanogpt: bool):
    C = shape["context_length"]
    keep = C // 2
    model = make_model(shape)
    kw = dict(SAMPLING, seed=SEED)
    configs = {name: SampleConfig(max_new_tokens=n, context_policy=name, **kw) for name in POLICIES}
    threads = {name: threads_for(model, CPU, config) for name, config in configs.items()}

    def policy(name: str) -> Contestant:
        return Contestant(lambda: sample_steps(model, [[1]], configs[name]), threads[name])

    contestants = {
        "shift": policy("shift"),
        "exact": policy("exact"),
        "full_recompute": Contestant(lambda: plain_loop_steps(model, [1], n, **SAMPLING)),
    }
    if nanogpt:
        contestants["nanogpt"] = Contestant(lambda: nanogpt_steps(model, [1], n, **SAMPLING))
    if baseline is not None:
        old = baseline_model(shape, baseline)
        contestants["today"] = Contestant(
            lambda: baseline["generate"].generate(old, [[1]], n, **kw)
        )
    for contestant in contestants.values():  # warm-up: the first steps of each
        with contestant.scope():
            timed(islice(contestant.start(), 8))
    runs = interleave(contestants, rounds, chunk=50)
    out: dict = {"shape": shape, "new_tokens": n, "keep": keep, "rounds": rounds}
    out["threads"] = {
        name: contestant.threads or torch.get_num_threads()
        for name, contestant in contestants.items()
    }
    for name, name_runs in runs.items():
        policy = name if name in ("shift", "exact") else None
        kinds = schedule(policy, 1, n, C, keep) if policy else None
        out[name] = summarize(name_runs, n, kinds)
    tokens = {name: name_runs[0][0] for name, name_runs in runs.items()}
    same = [tokens[k] for k in ("exact", "full_recompute", "nanogpt", "today") if k in tokens]
    out["exact_tokens_equal_recompute_nanogpt_today"] = all(t == same[0] for t in same)
    speed = {name: out[name]["tokens_per_s"] for name in runs}
    out["ratios"] = {
        f"shift_over_{name}": round(speed["shift"] / speed[name], 2)
        for name in speed
        if name != "shift"
    }
    if "today" in speed:
        out["ratios"]["exact_over_today"] = round(speed["exact"] / speed["today"], 2)
    return out


def decode_step(rounds: int, baseline: dict | None) -> dict:
    """The tiny model's in-context decode step: current vs baseline, 1 and 2 threads."""
    n = TINY["context_length"] - 1
    model = make_model(TINY)
    contestants: dict[str, Contestant] = {}
    out: dict = {"shape": TINY, "new_tokens": n, "rounds": rounds}
    settings = {"greedy": dict(temperature=0.0), "sampled": dict(SAMPLING, seed=SEED)}
    default = torch.get_num_threads()
    counts = sorted({1, 2, default})
    for label, kw in settings.items():
        config = SampleConfig(max_new_tokens=n, **kw)
        for threads in counts:
            contestants[f"current_{label}_{threads}t"] = Contestant(
                lambda config=config: sample_steps(model, [[1]], config), threads
            )
            if baseline is not None:
                old = baseline_model(TINY, baseline)
                contestants[f"today_{label}_{threads}t"] = Contestant(
                    lambda kw=kw, old=old: baseline["generate"].generate(old, [[1]], n, **kw),
                    threads,
                )
    interleave(contestants, 2, chunk=n)  # warm-up
    runs = interleave(contestants, rounds, chunk=n)
    ms, p10 = {}, {}
    for name, name_runs in runs.items():
        steps = sorted(s for _, per, _ in name_runs for s in per[1:])  # step 0 is the prefill
        ms[name] = round(statistics.median(steps) * 1e3, 3)
        p10[name] = round(steps[len(steps) // 10] * 1e3, 3)
    out["ms_per_decode_step"] = ms
    # The fastest tenth of the steps: what a step costs when other processes leave the CPU be.
    out["ms_per_decode_step_p10"] = p10
    out["auto_threads"] = threads_for(model, CPU, SampleConfig(max_new_tokens=n)) or default
    if baseline is not None:
        auto = out["auto_threads"]
        out["ratios"] = {
            f"today_{default}t_over_current_{auto}t_{label}": round(
                ms[f"today_{label}_{default}t"] / ms[f"current_{label}_{auto}t"], 2
            )
            for label in settings
        }
        for label in settings:
            for threads in counts:
                out["ratios"][f"same_threads_{label}_{threads}t"] = round(
                    ms[f"today_{label}_{threads}t"] / ms[f"current_{label}_{threads}t"], 2
                )
        out["tokens_equal"] = all(
            runs[f"today_{label}_{t}t"][0][0] == runs[f"current_{label}_{t}t"][0][0]
            for label in settings
            for t in counts
        )
    return out


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


def hf_greedy(hf, n: int, **kwargs) -> torch.Tensor:
    """`transformers` `generate`: exactly `n` greedy tokens after the 1-token prompt, cached."""
    prompt = torch.tensor([[1]])
    with torch.inference_mode():
        return hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
            eos_token_id=None,
            **kwargs,
        )


def vs_transformers_tiny(rounds: int) -> dict:
    """Per-step times of a finished HF run come from a streamer that stamps each token."""
    n = TINY["context_length"] - 1
    model = make_model(TINY)
    hf = to_transformers(model, TINY)
    auto = threads_for(model, CPU, SampleConfig(max_new_tokens=n))

    from transformers.generation.streamers import BaseStreamer

    def hf_timed() -> tuple[list[int], list[float], float]:
        stamps: list[float] = []

        class Stamps(BaseStreamer):
            def put(self, value: torch.Tensor) -> None:
                stamps.append(time.perf_counter())
                tokens.append(int(value.reshape(-1)[-1]))

            def end(self) -> None:
                pass

        tokens: list[int] = []
        start = time.perf_counter()
        hf_greedy(hf, n, streamer=Stamps())
        total = time.perf_counter() - start
        # put() gets the prompt first, then each new token.
        per = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
        return tokens[1:], per, total

    results: dict[str, list] = {"llmcli_shift": [], "transformers_1t": [], "transformers_2t": []}
    for r in range(rounds + 1):  # round 0 warms up
        order = list(results) if r % 2 else list(reversed(results))
        for name in order:
            threads = {"llmcli_shift": auto, "transformers_1t": 1, "transformers_2t": 2}[name]
            with torch_threads(threads):
                if name == "llmcli_shift":
                    greedy = SampleConfig(max_new_tokens=n, temperature=0.0, context_policy="shift")
                    tokens, per, total = timed(sample_steps(model, [[1]], greedy))
                    per = per[1:]  # the prefill
                else:
                    tokens, per, total = hf_timed()
            if r:
                results[name].append((tokens, per, total))
    out: dict = {"shape": TINY, "new_tokens": n, "rounds": rounds, "llmcli_threads": auto or 2}
    for name, runs in results.items():
        out[name] = {
            "tokens_per_s": round(n / statistics.median(t for _, _, t in runs), 1),
            "ms_per_step": round(statistics.median(s for _, per, _ in runs for s in per) * 1e3, 3),
        }
    best_hf = max(out[k]["tokens_per_s"] for k in ("transformers_1t", "transformers_2t"))
    best_hf_step = min(out[k]["ms_per_step"] for k in ("transformers_1t", "transformers_2t"))
    out["ratios"] = {
        "shift_over_best_transformers_tokens_per_s": round(
            out["llmcli_shift"]["tokens_per_s"] / best_hf, 2
        ),
        "shift_over_best_transformers_per_step": round(
            best_hf_step / out["llmcli_shift"]["ms_per_step"], 2
        ),
    }
    out["tokens_equal"] = results["llmcli_shift"][0][0] == results["transformers_2t"][0][0]
    return out


def mid_ctx512(n: int, rounds: int, baseline: dict | None) -> dict:
    """500 greedy tokens at context 512 (all inside it): current vs today, nanoGPT once."""
    model = make_model(MID)
    greedy = SampleConfig(max_new_tokens=n, temperature=0.0)
    contestants = {
        "current": Contestant(lambda: sample_steps(model, [[1]], greedy)),
    }
    if baseline is not None:
        old = baseline_model(MID, baseline)
        contestants["today"] = Contestant(
            lambda: baseline["generate"].generate(old, [[1]], n, temperature=0.0)
        )
    for contestant in contestants.values():
        with contestant.scope():
            timed(islice(contestant.start(), 8))
    runs = interleave(contestants, rounds, chunk=50)
    full = timed(nanogpt_steps(model, [1], n, temperature=0.0))
    out: dict = {"shape": MID, "new_tokens": n, "rounds": rounds}
    for name, name_runs in runs.items():
        out[name] = summarize(name_runs, n, schedule("exact", 1, n, MID["context_length"], 0))
    out["nanogpt_full_recompute"] = summarize([full], n)
    speed = {name: out[name]["tokens_per_s"] for name in runs}
    out["ratios"] = {
        "current_over_nanogpt": round(
            speed["current"] / out["nanogpt_full_recompute"]["tokens_per_s"], 2
        )
    }
    if "today" in speed:
        out["ratios"]["current_over_today"] = round(speed["current"] / speed["today"], 2)
    tokens = [name_runs[0][0] for name_runs in runs.values()] + [full[0]]
    out["tokens_equal"] = all(t == tokens[0] for t in tokens)
    return out


def latency(n: int = 1000, window: int = 100) -> dict:
    shape = {**MID, "context_length": 1024}
    model = make_model(shape)
    greedy = SampleConfig(max_new_tokens=n, temperature=0.0)
    timed(islice(sample_steps(model, [[1]], greedy), 8))
    _, per_token, _ = timed(sample_steps(model, [[1]], greedy))
    first = statistics.mean(per_token[:window]) * 1e3
    last = statistics.mean(per_token[-window:]) * 1e3
    return {
        "shape": shape,
        "new_tokens": n,
        "first_100_ms_per_token": round(first, 2),
        "last_100_ms_per_token": round(last, 2),
        "last_over_first": round(last / first, 2),
    }


def vs_transformers(n: int, rounds: int) -> dict:
    """The context-512 model, 500 greedy tokens, whole `generate` calls, median tokens/s."""
    model = make_model(MID)
    hf = to_transformers(model, MID)

    def run_hf() -> tuple[list[int], float]:
        start = time.perf_counter()
        ids = hf_greedy(hf, n)
        return ids[0, 1:].tolist(), time.perf_counter() - start

    def run_ours(new_tokens: int) -> tuple[list[int], list[float], float]:
        greedy = SampleConfig(max_new_tokens=new_tokens, temperature=0.0)
        return timed(sample_steps(model, [[1]], greedy))

    run_hf()  # warm-up (both)
    run_ours(8)
    ours_s, theirs_s = [], []
    for _ in range(rounds):
        ours_ids, _, s = run_ours(n)
        ours_s.append(s)
        hf_ids, s = run_hf()
        theirs_s.append(s)
    ours, theirs = statistics.median(ours_s), statistics.median(theirs_s)
    return {
        "shape": MID,
        "new_tokens": n,
        "rounds": rounds,
        "llmcli_tokens_per_s": round(n / ours, 1),
        "transformers_tokens_per_s": round(n / theirs, 1),
        "speedup": round(theirs / ours, 2),
        "tokens_equal": ours_ids == hf_ids,
    }


def batched_vs_sequential(shape: dict, lengths: list[int], n: int) -> dict:
    model = make_model(shape)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (L,), generator=g).tolist() for L in lengths]
    kw = dict(temperature=0.8, top_k=50)
    warm = SampleConfig(max_new_tokens=8, seed=0, **kw)
    timed(sample_steps(model, prompts[:1], warm))

    start = time.perf_counter()
    config = SampleConfig(max_new_tokens=n, seed=0, **kw)
    steps = list(sample_steps(model, prompts, config))
    batched_s = time.perf_counter() - start
    batched = torch.stack(steps, dim=1).tolist()  # (len(prompts), n)

    start = time.perf_counter()
    alone = []
    for i, p in enumerate(prompts):
        config = SampleConfig(max_new_tokens=n, seed=i, **kw)
        alone.append(timed(sample_steps(model, [p], config))[0])
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


def run_parts(args: argparse.Namespace, baseline: dict | None) -> dict:
    parts = set(args.parts.split(","))
    out: dict = {}
    if "long" in parts:
        out["long_generation"] = {
            "tiny_ctx64": long_generation(TINY, args.long_tokens, args.rounds, baseline, True),
            "6L_384_ctx256": long_generation(
                MID256, args.mid_long_tokens, args.mid_rounds, baseline, False
            ),
        }
    if "decode" in parts:
        out["decode_step"] = decode_step(args.decode_rounds, baseline)
    if "hf_tiny" in parts:
        out["vs_transformers_tiny"] = vs_transformers_tiny(args.decode_rounds)
    if "mid" in parts:
        out["mid_ctx512"] = mid_ctx512(args.new_tokens, args.rounds, baseline)
    if "latency" in parts:
        out["latency"] = latency(args.latency_tokens)
    if "hf_mid" in parts:
        out["vs_transformers"] = vs_transformers(args.new_tokens, args.rounds)
    if "batched" in parts:
        out["batched_vs_sequential"] = {
            "6L_384_ctx512": batched_vs_sequential(MID, spread(8, 128), args.batch_tokens),
            # Prompts and new tokens stay within the tiny model's 64-token context.
            "tiny_ctx64": batched_vs_sequential(TINY, spread(4, 36), 24),
        }
    return out


def headline(parts: dict) -> dict:
    """The ratios the targets are about, pulled out of the parts that ran."""
    ratios: dict = {}
    long = parts.get("long_generation", {})
    for name, part in long.items():
        for key, value in part["ratios"].items():
            ratios[f"{name}_{key}"] = value
    if "decode_step" in parts:
        part = parts["decode_step"]
        ratios.update({f"decode_{k}": v for k, v in part.get("ratios", {}).items()})
        auto = part["auto_threads"]
        for label in ("greedy", "sampled"):
            ratios[f"decode_ms_{label}_current_{auto}t"] = part["ms_per_decode_step"][
                f"current_{label}_{auto}t"
            ]
    if "vs_transformers_tiny" in parts:
        ratios.update(parts["vs_transformers_tiny"]["ratios"])
    if "mid_ctx512" in parts:
        ratios.update({f"ctx512_{k}": v for k, v in parts["mid_ctx512"]["ratios"].items()})
    if "vs_transformers" in parts:
        ratios["ctx512_llmcli_over_transformers"] = parts["vs_transformers"]["speedup"]
    if "batched_vs_sequential" in parts:
        for name, part in parts["batched_vs_sequential"].items():
            ratios[f"batched_over_sequential_{name}"] = part["speedup"]
    return ratios


TARGETS = {
    "tiny_ctx64_shift_over_full_recompute": ">= 3",
    "decode_today_2t_over_current_1t (in-context cached step, each at its default)": ">= 2",
    "decode_ms_*_current (auto threads)": "<= 0.7",
    "shift_over_best_transformers (tiny, inside the context)": ">= 1.5",
    "6L/384 (ctx512 current_over_today, ctx256 exact_over_today)": ">= 1 (no regression)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"any of {', '.join(PARTS)}")
    parser.add_argument("--threads", type=int, default=None, help="torch's own thread count")
    parser.add_argument("--baseline", default=BASELINE, help="git revision of 'today' ('' none)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mid-rounds", type=int, default=1, help="rounds of 6L/384 ctx 256")
    parser.add_argument("--decode-rounds", type=int, default=20)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--mid-long-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=500)
    parser.add_argument("--latency-tokens", type=int, default=1000)
    parser.add_argument("--batch-tokens", type=int, default=100)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    baseline = load_baseline(args.baseline) if args.baseline else None
    started = time.perf_counter()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()
    parts = run_parts(args, baseline)
    result = {
        "ratios": headline(parts),
        "targets": TARGETS,
        **parts,
        "machine": {
            "date": date,
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_at_start": [round(x, 2) for x in load],
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "baseline": None if baseline is None else baseline["rev"],
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
