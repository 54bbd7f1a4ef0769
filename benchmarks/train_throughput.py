"""Training-step speed: llmcli against `transformers` GPT-2 and a per-head model; JSON.

One training step = forward, loss, backward, gradient clipping (norm 1.0), optimizer step,
zero_grad, on random token batches held in memory (data loading is not timed here; see
RESULTS.md for the check of the real loop). Three models of the same sizes:

- `llmcli`: `llmcli.model.gpt.Transformer` with llmcli's own optimizer setup (`build_optimizer`:
  fused AdamW, decay groups) and the step `llmcli.training.loop` runs (loss kept on the device,
  clipping with `foreach`), fp32.
- `transformers`: `GPT2LMHeadModel` of the equivalent config (`llmcli.hf.gpt2.hf_config`: exact
  GELU, SDPA attention, tied head) with `torch.optim.AdamW` at its defaults and
  `clip_grad_norm_`, as a `transformers` user's loop does.
- `per_head`: the per-head layer written literally (below): a `ModuleList` of `Head`s, each with
  its own key/query/value `nn.Linear`, masked softmax, `torch.cat` of the heads, `proj`; the
  same blocks otherwise; `torch.optim.AdamW` at its defaults.

Rounds are interleaved in one process (matmul peak, then each model in turn, a few steps each,
the order rotating from round to round),
so that a shared, noisy machine slows every contestant alike; the figures are medians over
rounds and the ratios are of medians (the ratios of each contestant's fastest round, the least
disturbed by other jobs, are given too). Achieved FLOP/s use nanoGPT's count per token,
`6 N + 12 L T C` (N = parameters without the position table), and are compared with the best
fp32 GFLOP/s of a square matmul measured in the same rounds.

Every round also replays the GEMMs of the step's linear layers alone (forward, input and weight
gradients, same shapes): all three contestants run exactly these, so their time is a floor under
any step and bounds the ratio any implementation of the same model can reach over another.

`--compile tiny,...` adds `torch.compile(llmcli model)` for those configs: compile seconds,
steady-state tokens/s against eager and the number of steps after which compiling has paid off.

Usage: python benchmarks/train_throughput.py [--rounds 7] [--steps 5] [--threads N]
       [--configs tiny,6L_384_ctx256] [--compile tiny]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmcli.config import ModelConfig, TrainConfig  # noqa: E402
from llmcli.model.gpt import Transformer  # noqa: E402
from llmcli.training.optim import apply_lr, build_optimizer  # noqa: E402

VOCAB = 65  # the bundled corpus' characters
CONFIGS = {
    "tiny": dict(n_layer=4, n_head=4, n_embed=128, context_length=64, batch_size=12),
    "6L_384_ctx256": dict(n_layer=6, n_head=6, n_embed=384, context_length=256, batch_size=8),
}
TARGETS = {
    "tiny_over_transformers": 1.7,
    "tiny_over_per_head": 1.9,
    "6L_384_ctx256_fraction_of_matmul_peak": 0.85,
}


# ----------------------------------------------------------------------------- the per-head model


class SeedHead(nn.Module):
    """One causal attention head with its own key/query/value projections (the per-head formula)."""

    def __init__(self, n_embed: int, head_size: int, context_length: int, dropout: float) -> None:
        super().__init__()
        self.key = nn.Linear(n_embed, head_size, bias=False)
        self.query = nn.Linear(n_embed, head_size, bias=False)
        self.value = nn.Linear(n_embed, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(context_length, context_length)))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        k = self.key(x)  # (B, T, hs)
        q = self.query(x)  # (B, T, hs)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5  # (B, T, hs) @ (B, hs, T) -> (B, T, T)
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))  # (B, T, T)
        wei = self.dropout(F.softmax(wei, dim=-1))  # (B, T, T)
        v = self.value(x)  # (B, T, hs)
        return wei @ v  # (B, T, T) @ (B, T, hs) -> (B, T, hs)


class SeedMultiHeadAttention(nn.Module):
    def __init__(self, n_head: int, n_embed: int, context_length: int, dropout: float) -> None:
        super().__init__()
        hs = n_embed // n_head
        self.heads = nn.ModuleList(
            SeedHead(n_embed, hs, context_length, dropout) for _ in range(n_head)
        )
        self.proj = nn.Linear(n_embed, n_embed)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.cat([h(x) for h in self.heads], dim=-1)  # (B, T, nh * hs) = (B, T, C)
        return self.dropout(self.proj(out))  # (B, T, C)


class SeedBlock(nn.Module):
    def __init__(self, n_head: int, n_embed: int, context_length: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embed)
        self.sa = SeedMultiHeadAttention(n_head, n_embed, context_length, dropout)
        self.ln2 = nn.LayerNorm(n_embed)
        self.ffwd = nn.Sequential(
            nn.Linear(n_embed, 4 * n_embed),
            nn.GELU(),
            nn.Linear(4 * n_embed, n_embed),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.sa(self.ln1(x))  # (B, T, C)
        return x + self.ffwd(self.ln2(x))  # (B, T, C)


class SeedGPT(nn.Module):
    def __init__(
        self,
        vocab: int,
        n_layer: int,
        n_head: int,
        n_embed: int,
        context_length: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, n_embed)
        self.position_embedding = nn.Embedding(context_length, n_embed)
        self.blocks = nn.Sequential(
            *[SeedBlock(n_head, n_embed, context_length, dropout) for _ in range(n_layer)]
        )
        self.ln_f = nn.LayerNorm(n_embed)
        self.lm_head = nn.Linear(n_embed, vocab)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        B, T = idx.shape
        pos = self.position_embedding(torch.arange(T, device=idx.device))  # (T, C)
        x = self.token_embedding(idx) + pos  # (B, T, C)
        logits = self.lm_head(self.ln_f(self.blocks(x)))  # (B, T, V)
        return F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))


# ----------------------------------------------------------------------------- contestants


Step = Callable[[Tensor, Tensor], None]


def llmcli_step(shape: dict, compile_model: bool = False) -> tuple[Step, nn.Module]:
    """llmcli's model, optimizer and step, as `llmcli.training.loop` runs them (grad_accum 1)."""
    model_shape = {k: v for k, v in shape.items() if k != "batch_size"}
    model = Transformer(
        ModelConfig(**model_shape), VOCAB, generator=torch.Generator().manual_seed(0)
    )
    train_cfg = TrainConfig(device="cpu", max_steps=10**6, warmup_steps=0)
    optimizer = build_optimizer(model, train_cfg, "cpu")
    params = list(model.parameters())
    fwd = torch.compile(model) if compile_model else model
    loss_buf = torch.zeros(train_cfg.log_interval + 1)
    state = {"step": 0}

    def step(x: Tensor, y: Tensor) -> None:
        apply_lr(optimizer, state["step"], train_cfg)
        _, loss = fwd(x, y)
        loss.backward()
        loss_buf[state["step"] % train_cfg.log_interval] += loss.detach()
        nn.utils.clip_grad_norm_(params, train_cfg.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1

    return step, model


def hf_step(shape: dict) -> tuple[Step, nn.Module]:
    from transformers import GPT2Config, GPT2LMHeadModel

    from llmcli.hf.gpt2 import hf_config as gpt2_config

    model_shape = {k: v for k, v in shape.items() if k != "batch_size"}
    cfg = gpt2_config(ModelConfig(**model_shape), VOCAB, None)
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**cfg, attn_implementation="sdpa")).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def step(x: Tensor, y: Tensor) -> None:
        logits = model(input_ids=x).logits  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model


def per_head_step(shape: dict) -> tuple[Step, nn.Module]:
    torch.manual_seed(0)
    model = SeedGPT(
        VOCAB, shape["n_layer"], shape["n_head"], shape["n_embed"], shape["context_length"]
    ).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def step(x: Tensor, y: Tensor) -> None:
        loss = model(x, y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model


# ----------------------------------------------------------------------------- measuring


def matmul_gflops(n: int = 2048, reps: int = 3) -> float:
    """Best fp32 GFLOP/s of an (n, n) @ (n, n) matmul over `reps` tries."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def step_gemms(shape: dict) -> list[tuple[Tensor, Tensor]]:
    """Operands of every GEMM of a training step's linear layers (attention scores excluded).

    Per linear `i -> o` on `B*T` rows: forward `(BT, i) @ (i, o)`, input gradient
    `(BT, o) @ (o, i)`, weight gradient `(o, BT) @ (BT, i)`; the same for the LM head.
    """
    BT, C = shape["batch_size"] * shape["context_length"], shape["n_embed"]
    linears = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)] * shape["n_layer"] + [(C, VOCAB)]
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(m, k, generator=g), torch.randn(k, n, generator=g))
        for i, o in linears
        for m, k, n in ((BT, i, o), (BT, o, i), (o, BT, i))
    ]


def gemm_seconds(gemms: list[tuple[Tensor, Tensor]]) -> float:
    """Seconds to run the GEMMs once, one after another (a floor under any step's time)."""
    start = time.perf_counter()
    for a, b in gemms:
        torch.mm(a, b)
    return time.perf_counter() - start


def batches(shape: dict, n: int = 4) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    B, T = shape["batch_size"], shape["context_length"]
    out = []
    for _ in range(n):
        data = torch.randint(0, VOCAB, (B, T + 1), generator=g)
        out.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
    return out


def timed(step: Step, data: list[tuple[Tensor, Tensor]], steps: int) -> float:
    """Seconds per step over `steps` steps."""
    start = time.perf_counter()
    for i in range(steps):
        step(*data[i % len(data)])
    return (time.perf_counter() - start) / steps


def flops_per_token(model: Transformer, shape: dict) -> float:
    """nanoGPT's estimate: 6 N + 12 L T C (forward + backward, attention scores included)."""
    N = model.num_parameters(non_embedding=True)
    L, T, C = shape["n_layer"], shape["context_length"], shape["n_embed"]
    return 6 * N + 12 * L * T * C


def compare(name: str, shape: dict, rounds: int, steps: int) -> dict:
    data = batches(shape)
    tokens = shape["batch_size"] * shape["context_length"]
    contestants = {
        "llmcli": llmcli_step(shape),
        "transformers": hf_step(shape),
        "per_head": per_head_step(shape),
    }
    for step, _ in contestants.values():
        timed(step, data, 2)  # warm-up
    seconds: dict[str, list[float]] = {k: [] for k in contestants}
    peaks: list[float] = []
    gemms = step_gemms(shape)
    gemm_s: list[float] = []
    keys = list(contestants)
    for r in range(rounds):
        peaks.append(matmul_gflops())
        gemm_s.append(gemm_seconds(gemms))
        # Rotate the order: whoever runs right after the big matmuls shares the cores with
        # OpenMP threads still spinning from them, so every contestant takes that seat in turn.
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            seconds[key].append(timed(contestants[key][0], data, steps))
    tok_s = {k: tokens / statistics.median(v) for k, v in seconds.items()}
    fpt = flops_per_token(contestants["llmcli"][1], shape)
    achieved = [fpt * tokens / s / 1e9 for s in seconds["llmcli"]]
    per_round_fraction = [a / p for a, p in zip(achieved, peaks, strict=True)]
    return {
        "shape": shape,
        "tokens_per_step": tokens,
        "rounds": rounds,
        "steps_per_round": steps,
        "tokens_per_s": {k: round(v, 1) for k, v in tok_s.items()},
        "step_ms_median": {k: round(1e3 * statistics.median(v), 2) for k, v in seconds.items()},
        "step_ms_rounds": {k: [round(1e3 * s, 1) for s in v] for k, v in seconds.items()},
        "llmcli_over_transformers": round(tok_s["llmcli"] / tok_s["transformers"], 3),
        "llmcli_over_per_head": round(tok_s["llmcli"] / tok_s["per_head"], 3),
        # The fastest round of each: the least disturbed by other jobs on a shared machine.
        "best_round_over_transformers": round(
            min(seconds["transformers"]) / min(seconds["llmcli"]), 3
        ),
        "best_round_over_per_head": round(min(seconds["per_head"]) / min(seconds["llmcli"]), 3),
        "flops_per_token": fpt,
        "llmcli_gflops_median": round(statistics.median(achieved), 1),
        "matmul_peak_gflops_best": round(max(peaks), 1),
        "matmul_peak_gflops_median": round(statistics.median(peaks), 1),
        "fraction_of_peak": round(statistics.median(achieved) / max(peaks), 3),
        "fraction_of_peak_per_round_median": round(statistics.median(per_round_fraction), 3),
        # Every contestant runs these same GEMMs; the rest of a step is where they differ.
        "linear_gemms_ms_median": round(1e3 * statistics.median(gemm_s), 2),
        "gemm_share_of_step": {
            k: round(statistics.median(gemm_s) / statistics.median(v), 3)
            for k, v in seconds.items()
        },
        "max_ratio_over_transformers_if_only_gemms_were_left": round(
            statistics.median(seconds["transformers"]) / statistics.median(gemm_s), 3
        ),
    }


def compile_payback(shape: dict, rounds: int, steps: int) -> dict:
    """Compile seconds of `torch.compile(model)` and its steady-state speed against eager.

    The compile is cold, as in a user's first run: inductor's on-disk cache is pointed at an
    empty temporary folder first (a warm cache makes later compiles much quicker).
    """
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-bench-")
    data = batches(shape)
    tokens = shape["batch_size"] * shape["context_length"]
    eager, _ = llmcli_step(shape)
    compiled, _ = llmcli_step(shape, compile_model=True)
    start = time.perf_counter()
    compiled(*data[0])  # the first step compiles the forward and the backward
    first_s = time.perf_counter() - start
    timed(eager, data, 2)
    timed(compiled, data, 2)
    e, c = [], []
    for r in range(rounds):
        pair = ((eager, e), (compiled, c))
        for step, times in pair if r % 2 == 0 else pair[::-1]:
            times.append(timed(step, data, steps))
    e_s, c_s = statistics.median(e), statistics.median(c)
    compile_s = first_s - c_s
    saved = e_s - c_s
    return {
        "shape": shape,
        "compile_s": round(compile_s, 1),
        "eager_tokens_per_s": round(tokens / e_s, 1),
        "compiled_tokens_per_s": round(tokens / c_s, 1),
        "compiled_over_eager": round(e_s / c_s, 3),
        "break_even_steps": round(compile_s / saved) if saved > 0 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=5, help="training steps per round")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's own choice)"
    )
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument(
        "--compile",
        default="",
        help="configs (comma-separated) for which to also measure torch.compile",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    started = time.perf_counter()
    load_start = os.getloadavg()
    results = {
        name: compare(name, CONFIGS[name], args.rounds, args.steps)
        for name in args.configs.split(",")
    }
    ratios = {}
    if "tiny" in results:
        ratios["tiny_over_transformers"] = results["tiny"]["llmcli_over_transformers"]
        ratios["tiny_over_per_head"] = results["tiny"]["llmcli_over_per_head"]
    if "6L_384_ctx256" in results:
        big = results["6L_384_ctx256"]
        ratios["6L_384_ctx256_over_transformers"] = big["llmcli_over_transformers"]
        ratios["6L_384_ctx256_over_per_head"] = big["llmcli_over_per_head"]
        ratios["6L_384_ctx256_fraction_of_matmul_peak"] = big["fraction_of_peak"]
        ratios["6L_384_ctx256_fraction_of_matmul_peak_per_round"] = big[
            "fraction_of_peak_per_round_median"
        ]
    out: dict = {"ratios": ratios, "targets": TARGETS, **results}
    if args.compile:
        out["compile"] = {
            name: compile_payback(CONFIGS[name], args.rounds, args.steps)
            for name in args.compile.split(",")
        }
    out["machine"] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": [round(x, 2) for x in load_start],
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    out["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
