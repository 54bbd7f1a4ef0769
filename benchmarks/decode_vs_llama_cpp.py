"""The decode step against llama.cpp's, on the same weights (the run's f32 GGUF export).

    pip install llama-cpp-python gguf
    OMP_NUM_THREADS=1 python benchmarks/decode_vs_llama_cpp.py --run RUN [--run RUN ...]
        [--threads 1,2] [--rows 1,8] [--tokens 50] [--rounds 7] [--prompt "ROMEO:"]

Each run (a byte-level BPE run, which `llmcli export --format gguf` writes) is exported as an
f32 GGUF file and loaded by llama.cpp beside llmcli's own model. Every side generates greedily
from the prompt, each row the same prompt (a group of completions, `--num-samples`, the
server's `n`):

- `llmcli`: as `llmcli sample` runs it, `generate_ids(model, prompts, config)` at temperature 0:
  the fast step (`llmcli.generation.fast_decode`), its default;
- `llmcli_compiled`: the step compiled by AOTInductor (`llmcli.generation.compiled_decode`;
  compiled once per run and rows, before the timing, and kept in the compile cache), in every
  case: `llmcli sample --compile` takes it only where it pays (benchmarks/compiled_step.py);
- `llmcli_forward`: every step through the model's forward (`decode=None`);
- `llama_cpp`: llama.cpp through `llama-cpp-python`'s C API (its model, context and batch, an
  f32 KV cache, flash attention off: its faster setting here): the prompt's tokens of every row
  as one batch, then one batch of one token per row per step, the next token the argmax of
  each row's logits (`llama_get_logits_ith`, read through NumPy);
- `llama_cpp_python` (one row only): the binding's own loop, `Llama.generate` with its sampler
  chain at temperature 0.

A step's time is `(t(1 + N) - t(1)) / N`, the difference of generating `1 + N` and 1 new tokens
(`--tokens` N, inside the context): set-up, the prefill and the first draw cancel out, and what
is left is the decode steps with the loop that drives them, for each side. Rounds rotate the
order of the sides, each round timing each side `--runs` times (median); figures are medians
over rounds. `ratio` is llmcli's step over llama.cpp's (C API), `ratio_compiled` the compiled
step's (the target: at most 1.5 with one thread, one row).

`tokens_equal_plain`, `compiled_tokens_equal_plain`: llmcli's tokens equal its plain loop's
(`llmcli.generation.loop.generate`, the whole window recomputed every step);
`tokens_equal_llama_cpp`: llama.cpp drew the same tokens (its GPT-2 graph computes GELU from a
float16 table, so a near-tie may go the other way: benchmarks/gguf_check.py). Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf_check import GGML_TYPE_F32, open_llama

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.config import SampleConfig  # noqa: E402
from llmcli.generation.compiled_decode import CompiledDecoder  # noqa: E402
from llmcli.generation.engine import generate_ids  # noqa: E402
from llmcli.generation.fast_decode import FastDecoder  # noqa: E402
from llmcli.generation.loop import generate as plain_generate  # noqa: E402
from llmcli.runs.loading import load_run  # noqa: E402


class LlamaCpp:
    """Greedy generation in llama.cpp through its C API, `rows` sequences decoded as one batch."""

    quiet: object = None  # the log callback that drops llama.cpp's notes (alive while in use)

    def __init__(self, path: Path, n_ctx: int, rows: int, threads: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        if LlamaCpp.quiet is None:  # its loading and graph notes, on stderr otherwise
            LlamaCpp.quiet = lc.llama_log_callback(lambda level, text, user_data: None)
            lc.llama_log_set(LlamaCpp.quiet, None)
        lc.llama_backend_init()
        params = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        context = lc.llama_context_default_params()
        context.n_ctx = n_ctx * rows  # split among the sequences: n_ctx each
        context.n_batch = context.n_ubatch = n_ctx * rows
        context.n_seq_max = rows
        context.n_threads = context.n_threads_batch = threads
        context.type_k = context.type_v = GGML_TYPE_F32
        # Its default ("auto") turns flash attention on, which takes 4x as long per step here.
        context.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = lc.llama_init_from_model(self.model, context)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(context.n_batch, 0, rows)
        self.rows = rows

    def _decode(self, tokens: list[list[int]], start: int) -> list[int]:
        """Feed `tokens[r]` to sequence `r` at positions `start ..`; each row's argmax after its
        last token."""
        batch, i, last = self.batch, 0, []
        for row, ids in enumerate(tokens):
            for offset, token in enumerate(ids):
                batch.token[i] = token
                batch.pos[i] = start + offset
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = row
                batch.logits[i] = offset == len(ids) - 1
                i += 1
            last.append(i - 1)
        batch.n_tokens = i
        if self.lc.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        logits = (self.lc.llama_get_logits_ith(self.ctx, i) for i in last)
        return [int(np.ctypeslib.as_array(p, shape=(self.vocab,)).argmax()) for p in logits]

    def generate(self, prompt: list[int], n: int) -> list[list[int]]:
        """`n` greedy tokens after `prompt` in every row."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        new = [self._decode([prompt] * self.rows, 0)]
        for step in range(1, n):
            new.append(self._decode([[t] for t in new[-1]], len(prompt) + step - 1))
        return [list(row) for row in zip(*new, strict=True)]

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def python_api(path: Path, n_ctx: int, threads: int) -> Callable[[list[int], int], list[int]]:
    """`llama-cpp-python`'s own greedy loop (`Llama.generate`: its sampler chain at temperature
    0), one sequence: `fn(prompt, n)` gives the first `n` new tokens."""
    llm = open_llama(path, n_ctx, threads)

    def generate(prompt: list[int], n: int) -> list[int]:
        steps = llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
        return [token for token, _ in zip(steps, range(n), strict=False)]

    return generate


def note(message: str) -> None:
    print(message, file=sys.stderr)


def export_gguf(run: Path, out: Path) -> None:
    """`llmcli export --format gguf --dtype f32` of this checkout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "llmcli", "export", "--checkpoint", str(run), "--out", str(out)]
    cmd += ["--format", "gguf", "--dtype", "f32", "--force"]
    subprocess.run(cmd, check=True, capture_output=True, env=env)


def step_ms(generate: Callable[[int], object], n: int, runs: int) -> float:
    """The median over `runs` of `(t(1 + n) - t(1)) / n`, in milliseconds."""
    steps = []
    for _ in range(runs):
        start = time.perf_counter()
        generate(1)
        one = time.perf_counter() - start
        start = time.perf_counter()
        generate(1 + n)
        steps.append((time.perf_counter() - start - one) / n)
    return statistics.median(steps) * 1e3


def compare(run: Path, gguf: Path, prompt: str, rows: int, threads: int, args) -> dict:
    """llmcli's and llama.cpp's decode step on one run, `rows` rows at `threads` threads."""
    torch.set_num_threads(threads)
    loaded = load_run(run)
    model = loaded.model
    ids = loaded.tokenizer.encode(prompt)
    n = args.tokens
    if len(ids) + n + 1 > model.context_length:
        raise SystemExit(f"{run}: {len(ids)} prompt + {n + 1} new tokens exceed the context")
    decode = FastDecoder.for_model(model)

    def ours(k: int) -> list[list[int]]:
        config = SampleConfig(max_new_tokens=k, temperature=0.0)
        return generate_ids(model, [ids] * rows, config, decode=decode)

    def forward(k: int) -> list[list[int]]:
        config = SampleConfig(max_new_tokens=k, temperature=0.0)
        return generate_ids(model, [ids] * rows, config, decode=None)

    compiled_step = CompiledDecoder.for_model(
        model, rows, notify=lambda m: print(m, file=sys.stderr)
    )

    def compiled(k: int) -> list[list[int]]:
        config = SampleConfig(max_new_tokens=k, temperature=0.0)
        return generate_ids(model, [ids] * rows, config, decode=compiled_step)

    llama = LlamaCpp(gguf, model.context_length, rows, threads)
    sides: dict[str, Callable[[int], object]] = {
        "llmcli": ours,
        "llmcli_compiled": compiled,
        "llmcli_forward": forward,
        "llama_cpp": lambda k: llama.generate(ids, k),
    }
    if rows == 1:
        high_level = python_api(gguf, model.context_length, threads)
        sides["llama_cpp_python"] = lambda k: high_level(ids, k)
    for side in sides.values():  # warm-up
        step_ms(side, n, 1)
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(args.rounds):  # the order rotates round by round
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(step_ms(sides[name], n, args.runs))
    tokens, tokens_compiled = ours(1 + n), compiled(1 + n)
    with torch.inference_mode():
        prompts = torch.tensor([ids] * rows)
        plain = plain_generate(model, prompts, 1 + n, temperature=0.0)[:, len(ids) :].tolist()
    theirs = llama.generate(ids, 1 + n)
    llama.close()
    ms = {name: statistics.median(t) for name, t in times.items()}
    return {
        "rows": rows,
        "threads": threads,
        **{f"{name}_step_ms": round(value, 4) for name, value in ms.items()},
        "ratio": round(ms["llmcli"] / ms["llama_cpp"], 3),
        "ratio_compiled": round(ms["llmcli_compiled"] / ms["llama_cpp"], 3),
        "tokens_equal_plain": tokens == plain,
        "compiled_tokens_equal_plain": tokens_compiled == plain,
        "tokens_equal_llama_cpp": tokens == theirs,
    }


def describe(run: Path) -> dict:
    model = load_run(run).model
    config = model.config
    return {
        "run": str(run),
        "shape": f"{config.n_layer}L/{config.n_embed}, {config.n_head} heads",
        "context_length": config.context_length,
        "vocab_size": model.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, action="append", required=True)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--rows", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--tokens", type=int, default=50, help="decode steps timed")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=3, help="timings per round and side")
    parser.add_argument("--prompt", default="ROMEO:")
    args = parser.parse_args()
    import llama_cpp

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in args.run:
            gguf = Path(tmp) / f"{run.name}.gguf"
            export_gguf(run, gguf)
            cases = [
                compare(run, gguf, args.prompt, int(rows), int(threads), args)
                for rows in args.rows.split(",")
                for threads in args.threads.split(",")
            ]
            results.append({**describe(run), "cases": cases})
    print(
        json.dumps(
            {
                "benchmark": "decode_vs_llama_cpp",
                "tokens": args.tokens,
                "rounds": args.rounds,
                "runs": args.runs,
                "prompt": args.prompt,
                "results": results,
                "llama_cpp_python": llama_cpp.__version__,
                "torch": torch.__version__,
                "machine": platform.machine(),
                "cpu_threads": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
