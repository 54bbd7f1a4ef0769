"""Data pipeline throughput and memory: prints one JSON object.

1. BPE tokenization speed over the bundled corpus repeated to >= `--mb` MB (default 50):
   - `prepare_data`: llmcli's path (read, hash, cut into pieces, parallel `encode_batch`,
     write the uint16 cache), with the tokenizer given so that only tokenizing is timed;
   - `encode_batch`: the parallel batch call alone, on the same pieces, in memory;
   - `per_line_loop`: a Python loop calling `encode` on each line (the naive way).
   The last two stop after `--cap-s` seconds each; their rate is over the part done.
2. Peak memory while drawing 1,000 batches (B=64, T=256) from a 1 GiB synthetic uint16 token file
   vs a 10 MB one, each in a fresh process: llmcli's `BatchSampler` on an `np.memmap` (reads each
   window with `os.pread`), fancy-indexing the memory map itself (`memmap_gather`), and nanoGPT's
   way (a new `np.memmap` per batch). `growth_mb` is the peak RSS during sampling minus the RSS
   before it.

The synthetic files live in a temporary folder (default under /tmp) and are deleted at the end.

Usage: python benchmarks/data_throughput.py [--mb 50] [--big-gb 1.0] [--cap-s 45] [--tmp /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data" / "shakespeare.txt"

# Runs in a fresh interpreter: one memory measurement, printed as JSON.
SAMPLER_CHILD = r"""
import json, mmap, resource, sys, time
import numpy as np, torch
sys.path.insert(0, sys.argv[4])
from llmcli.data.batches import BatchSampler

path, method, n_batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
B, T = 64, 256

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB -> MB
    return float("nan")

tokens = np.memmap(path, dtype=np.uint16, mode="r")
sampler = BatchSampler(tokens, B, T, seed=0)
if method == "memmap_gather":
    sampler.close()  # no file reads: fancy-index the memory map (what plain numpy code does)
sampler.next()  # warm up (torch kernels, first faults)
try:  # reset the peak-RSS mark, so VmHWM measures the sampling only
    open("/proc/self/clear_refs", "w").write("5")
except OSError:
    pass
before = status("VmRSS")
t0 = time.perf_counter()
checksum = 0
for _ in range(n_batches):
    if method == "nanogpt":  # nanoGPT train.py: recreate the memmap every batch
        data = np.memmap(path, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - T, (B,), generator=sampler.generator)
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        del data
    else:
        x, y = sampler.next()
    checksum += int(x[0, 0])
elapsed = time.perf_counter() - t0
print(json.dumps({
    "rss_before_mb": round(before, 1),
    "peak_rss_mb": round(status("VmHWM"), 1),
    "growth_mb": round(status("VmHWM") - before, 1),
    "rss_file_after_mb": round(status("RssFile"), 1),
    "ms_per_batch": round(1000 * elapsed / n_batches, 3),
}))
"""


def _rate(nbytes: int, seconds: float) -> float:
    return round(nbytes / 1e6 / seconds, 2)


def tokenization(mb: float, tmp: Path, cap_s: float) -> dict:
    from llmcli.config import DataConfig
    from llmcli.data.token_cache import BATCH_CHARS, _pieces
    from llmcli.data.tokenizer import BPETokenizer
    from llmcli.data.tokens import prepare_data

    corpus = CORPUS.read_text(encoding="utf-8")
    t0 = time.perf_counter()
    tok = BPETokenizer.train([corpus], vocab_size=1024)
    train_s = time.perf_counter() - t0
    repeats = -(-int(mb * 1e6) // len(corpus.encode("utf-8")))
    text = "\n".join([corpus] * repeats)
    nbytes = len(text.encode("utf-8"))
    big = tmp / f"corpus_x{repeats}.txt"
    big.write_text(text, encoding="utf-8")
    out: dict = {
        "corpus_mb": round(nbytes / 1e6, 1),
        "vocab_size": tok.vocab_size,
        "bpe_train_s_on_bundled_corpus": round(train_s, 2),
    }

    # llmcli's path over the whole corpus: read, hash, cut, parallel encode_batch, write.
    cfg = DataConfig(path=str(big), val_fraction=0.01)
    t0 = time.perf_counter()
    data = prepare_data(cfg, 256, tokenizer=tok, cache_dir=tmp / "cache")
    dt = time.perf_counter() - t0
    out["prepare_data"] = {
        "s": round(dt, 2),
        "mb": round(nbytes / 1e6, 1),
        "mb_per_s": _rate(nbytes, dt),
        "tokens": len(data.train) + len(data.val),
    }
    t0 = time.perf_counter()
    prepare_data(cfg, 256, tokenizer=tok, cache_dir=tmp / "cache")
    out["prepare_data_cache_hit_s"] = round(time.perf_counter() - t0, 2)

    # The two encoding strategies alone, in memory, each stopped after `cap_s` seconds (the
    # rate is over the part done), so that the benchmark stays bounded on a slow machine.
    def timed(batches) -> dict:
        done = tokens = 0
        t0 = time.perf_counter()
        for texts, encode in batches:
            tokens += sum(len(ids) for ids in encode(texts))
            done += sum(len(t.encode("utf-8")) for t in texts)
            if time.perf_counter() - t0 > cap_s:
                break
        dt = time.perf_counter() - t0
        return {
            "s": round(dt, 2),
            "mb": round(done / 1e6, 1),
            "mb_per_s": _rate(done, dt),
            "tokens": tokens,
        }

    def piece_batches():
        batch: list[str] = []
        chars = 0
        for piece in _pieces([text]):
            batch.append(piece)
            chars += len(piece)
            if chars >= BATCH_CHARS:
                yield batch, tok.encode_batch
                batch, chars = [], 0
        if batch:
            yield batch, tok.encode_batch

    def line_batches():
        lines = text.splitlines(keepends=True)
        for i in range(0, len(lines), 10_000):
            yield lines[i : i + 10_000], lambda ls: [tok.encode(line) for line in ls]

    out["encode_batch"] = timed(piece_batches())
    out["per_line_loop"] = timed(line_batches())
    loop = out["per_line_loop"]["mb_per_s"]
    out["speedup_prepare_data_vs_loop"] = round(out["prepare_data"]["mb_per_s"] / loop, 2)
    out["speedup_encode_batch_vs_loop"] = round(out["encode_batch"]["mb_per_s"] / loop, 2)
    return out


def write_tokens(path: Path, nbytes: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    chunk = 32 << 20  # tokens per write
    with open(path, "wb") as f:
        left = nbytes // 2
        while left:
            n = min(chunk, left)
            f.write(rng.integers(0, 1024, size=n, dtype=np.uint16).tobytes())
            left -= n


def memory(big_gb: float, tmp: Path, n_batches: int) -> dict:
    files = {
        "10MB": (tmp / "tokens_10mb.bin", 10 * 10**6),
        f"{big_gb:g}GiB": (tmp / "tokens_big.bin", int(big_gb * 2**30)),
    }
    out: dict = {"batch_size": 64, "context_length": 256, "batches": n_batches}
    for name, (path, nbytes) in files.items():
        t0 = time.perf_counter()
        write_tokens(path, nbytes)
        out.setdefault("write_s", {})[name] = round(time.perf_counter() - t0, 1)
    for method in ("llmcli", "memmap_gather", "nanogpt"):
        out[method] = {}
        for name, (path, _) in files.items():
            res = subprocess.run(
                [sys.executable, "-c", SAMPLER_CHILD, str(path), method, str(n_batches), str(ROOT)],
                capture_output=True,
                text=True,
                check=True,
            )
            out[method][name] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50, help="tokenization corpus size, MB")
    parser.add_argument("--big-gb", type=float, default=1.0, help="large token file, GiB")
    parser.add_argument("--batches", type=int, default=1000, help="batches per memory run")
    parser.add_argument(
        "--cap-s",
        type=float,
        default=45,
        help="time cap of each in-memory encoding measurement, seconds",
    )
    parser.add_argument("--tmp", default=tempfile.gettempdir(), help="folder for big files")
    parser.add_argument("--skip-tokenization", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import tokenizers
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="llmcli-bench-", dir=args.tmp))
    result: dict = {
        "benchmark": "data_throughput",
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_start": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
            "torch": torch.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    t_start = time.perf_counter()
    try:
        if not args.skip_tokenization:
            result["bpe_tokenization"] = tokenization(args.mb, tmp, args.cap_s)
        if not args.skip_memory:
            result["sampler_memory"] = memory(args.big_gb, tmp, args.batches)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["machine"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
