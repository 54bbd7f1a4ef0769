"""`llmcli export --format gguf` checked with llama.cpp itself (through `llama-cpp-python`).

For each run: the run is exported as GGUF (f32, and f16), loaded by llama.cpp on the CPU with an
f32 KV cache, and compared with llmcli on one prompt:

- the prompt's tokens: llama.cpp's tokenizer (from the file's vocabulary and merges) against the
  run's tokenizer;
- the prompt's logits at every position: the largest absolute difference (target, f32: 1e-3);
- greedy text: `--tokens` tokens chosen by argmax in llama.cpp against `llmcli sample
  --temperature 0` (the command itself, its text and, in process, its token ids).

llama.cpp's `gpt2` and `gptneox` graphs compute GELU from a float16 table of its tanh
approximation (`ggml_vec_gelu_f32` with `GGML_GELU_FP16`), where llmcli's is the exact erf GELU
in float32. For those runs the logits are also compared with llmcli's model run with llama.cpp's
GELU (`llama_cpp_gelu`), which tells that difference apart from the export's.

The runs must be byte-level BPE runs whose context holds the prompt and the new tokens. Prints
JSON, one object per run and precision.

Usage:
    pip install gguf llama-cpp-python
    llmcli train tiny --set data.path=data/tinyshakespeare.txt --set data.tokenizer=bpe \\
        --set data.vocab_size=512 --set model.n_layer=2 --set model.n_embed=64 \\
        --set model.context_length=128 --set train.max_steps=400 --out checkpoints/gguf-gpt2
    python benchmarks/gguf_check.py --run checkpoints/gguf-gpt2 [--run ...] [--prompt TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
GGML_TYPE_F32 = 0
TORCH_GELU = torch.nn.functional.gelu


def llmcli(*args: str) -> str:
    """Run the `llmcli` command of this checkout; its stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "llmcli", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout


def llama_cpp_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU as llama.cpp's CPU backend computes it: the tanh approximation of the input rounded
    to float16, rounded to float16 (its table), and x itself past +-10."""
    x16 = x.half().float()
    table = TORCH_GELU(x16, approximate="tanh").half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, table))


def llmcli_side(run_dir: Path, prompt: str, n: int) -> dict:
    """llmcli's prompt ids, prompt logits (T, V), greedy ids and `llmcli sample` text."""
    from llmcli.config import SampleConfig
    from llmcli.generation.engine import generate_ids
    from llmcli.runs.loading import load_run

    run = load_run(run_dir, device="cpu")
    ids = run.tokenizer.encode(prompt)
    with torch.no_grad():
        logits, _ = run.model(torch.tensor([ids]))
        torch.nn.functional.gelu = llama_cpp_gelu  # what llmcli's MLP calls, for this forward
        try:
            llama_gelu_logits, _ = run.model(torch.tensor([ids]))
        finally:
            torch.nn.functional.gelu = TORCH_GELU
    config = SampleConfig(max_new_tokens=n, temperature=0.0)
    [new] = generate_ids(run.model, [ids], config)
    eot = run.tokenizer.eot_id
    if eot in new:
        new = new[: new.index(eot)]
    sample = llmcli(
        "sample", "--checkpoint", str(run_dir), "--prompt", prompt, "--temperature", "0",
        "--max-new-tokens", str(n), "--json",
    )  # fmt: skip
    return {
        "ids": ids,
        "logits": logits[0].double().numpy(),
        "logits_llama_gelu": llama_gelu_logits[0].double().numpy(),
        "mlp": run.config.model.mlp,
        "greedy": new,
        "text": json.loads(sample)["completion"],
        "eot": eot,
        "context_length": run.model.context_length,
    }


def open_llama(path: Path, n_ctx: int, threads: int, logits_all: bool = False) -> Any:
    """The GGUF file in llama.cpp (`llama_cpp.Llama`) on the CPU: an f32 KV cache, flash
    attention off, quiet."""
    from llama_cpp import Llama

    return Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        logits_all=logits_all,
        n_threads=threads,
        n_threads_batch=threads,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        flash_attn=False,
        verbose=False,
    )


def llama_side(path: Path, prompt: str, n: int, n_ctx: int, threads: int) -> dict:
    """llama.cpp's prompt ids, prompt logits, greedy ids (argmax, until EOS) and their text."""
    llm = open_llama(path, n_ctx, threads, logits_all=True)
    ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=False)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
    new: list[int] = []
    for _ in range(n):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if token == llm.token_eos():
            break
        new.append(token)
        llm.eval([token])
    text = llm.detokenize(new).decode("utf-8", errors="replace")
    return {"ids": ids, "logits": logits, "greedy": new, "text": text, "arch": llm.metadata}


def check(run_dir: Path, dtype: str, prompt: str, n: int, threads: int, ours: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"model-{dtype}.gguf"
        llmcli("export", "--checkpoint", str(run_dir), "--format", "gguf", "--dtype", dtype,
               "--out", str(path))  # fmt: skip
        theirs = llama_side(path, prompt, n, ours["context_length"], threads)
        size = path.stat().st_size
    diff = np.abs(theirs["logits"] - ours["logits"])
    same = [a == b for a, b in zip(ours["greedy"], theirs["greedy"], strict=False)]
    first_diff = same.index(False) if False in same else None
    return {
        "run": str(run_dir),
        "architecture": theirs["arch"].get("general.architecture"),
        "dtype": dtype,
        "file_bytes": size,
        "prompt": prompt,
        "prompt_tokens_equal": ours["ids"] == theirs["ids"],
        "prompt_tokens": len(ours["ids"]),
        "logits_max_abs_diff": float(diff.max()),
        "logits_max_abs": float(np.abs(ours["logits"]).max()),
        "logits_within_1e-3": bool(diff.max() <= 1e-3),
        "logits_max_abs_diff_with_llama_cpp_gelu": (
            float(np.abs(theirs["logits"] - ours["logits_llama_gelu"]).max())
            if ours["mlp"] == "gelu"
            else None
        ),
        "greedy_tokens_llmcli": len(ours["greedy"]),
        "greedy_tokens_llama_cpp": len(theirs["greedy"]),
        "greedy_ids_equal": ours["greedy"] == theirs["greedy"],
        "first_different_token": first_diff,
        "greedy_text_equal_llmcli_sample": theirs["text"] == ours["text"],
        "llama_cpp_text": theirs["text"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, help="a BPE run (repeatable)")
    parser.add_argument("--prompt", default="ROMEO:")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtypes", default="f32,f16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for run in args.run:
        ours = llmcli_side(Path(run), args.prompt, args.tokens)
        for dtype in args.dtypes.split(","):
            result = check(Path(run), dtype, args.prompt, args.tokens, args.threads, ours)
            print(json.dumps(result, ensure_ascii=False), flush=True)


if __name__ == "__main__":
    main()
