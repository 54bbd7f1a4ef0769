"""`llmcli serve` throughput: tokens/s with 1, 4 and 16 concurrent clients; prints JSON.

The server runs as its own process (`python -m llmcli serve`, one torch thread as `llmcli sample`
picks for a small model), so the clients' Python does not share its interpreter. Each client
sends `--requests` completions one after another (`max_tokens` new tokens each, the run's
sampling settings, every request its own seed), so that `c` clients keep about `c` requests
waiting. Two servers are measured, interleaved round by round: `batched` (the default: requests
that arrive together run as one padded batch) and `one_at_a_time` (`--max-batch 1`). Throughput
is the completion tokens of all requests over the wall time from the first request sent to the
last answer; the median over rounds. The texts must be equal on both servers, request by request
(the batch a request lands in does not change its text).

Usage: OMP_NUM_THREADS=1 python benchmarks/serve_throughput.py [--run checkpoints/tiny]
       [--clients 1,4,16] [--requests 4] [--max-tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def server(run: str, *extra: str):
    """`llmcli serve` on a free port in a child process; yields its base URL."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "llmcli", "serve", "--checkpoint", run, "--port", "0", *extra]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        url = None
        for line in proc.stderr:
            match = re.search(r"at (http://\S+)/v1 ", line)
            if match:
                url = match[1]
                break
        if url is None:
            raise RuntimeError(f"the server did not start: {proc.wait()}")
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def load(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    """`clients` threads, each sending `requests` completions in turn; tokens/s and texts."""
    texts: dict[tuple[int, int], str] = {}
    tokens, latencies = [0] * clients, []

    def client(c: int) -> None:
        with httpx.Client(timeout=300) as http:
            for i in range(requests):
                seed = 1000 * c + i
                body = {"prompt": "ROMEO:", "max_tokens": max_tokens, "seed": seed}
                start = time.perf_counter()
                reply = http.post(f"{url}/v1/completions", json=body).json()
                latencies.append(time.perf_counter() - start)
                texts[c, i] = reply["choices"][0]["text"]
                tokens[c] += reply["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {
        "tokens_per_s": sum(tokens) / wall,
        "wall_s": wall,
        "median_latency_s": statistics.median(latencies),
        "texts": texts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="checkpoints/tiny")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    modes = {"batched": (), "one_at_a_time": ("--max-batch", "1")}
    figures: dict[str, dict[int, list[dict]]] = {m: {c: [] for c in clients} for m in modes}
    equal = True
    with server(args.run) as batched, server(args.run, *modes["one_at_a_time"]) as single:
        urls = {"batched": batched, "one_at_a_time": single}
        load(batched, 1, 1, 8), load(single, 1, 1, 8)  # warm up both
        for r in range(args.rounds):
            for c in clients:
                order = list(modes) if r % 2 == 0 else list(reversed(modes))
                got = {m: load(urls[m], c, args.requests, args.max_tokens) for m in order}
                equal &= got["batched"]["texts"] == got["one_at_a_time"]["texts"]
                for m in modes:
                    figures[m][c].append(got[m])
        stats = httpx.get(f"{batched}/health").json()
    table = {}
    for c in clients:
        row = {}
        for m in modes:
            runs = figures[m][c]
            row[m] = {
                "tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in runs), 1),
                "median_latency_s": round(
                    statistics.median(x["median_latency_s"] for x in runs), 3
                ),
            }
        row["batched_over_one_at_a_time"] = round(
            row["batched"]["tokens_per_s"] / row["one_at_a_time"]["tokens_per_s"], 2
        )
        table[str(c)] = row
    print(
        json.dumps(
            {
                "benchmark": "serve_throughput",
                "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                "torch": torch.__version__,
                "run": args.run,
                "requests_per_client": args.requests,
                "max_tokens": args.max_tokens,
                "rounds": args.rounds,
                "clients": table,
                "same_texts_batched_and_alone": equal,
                "batched_server": {k: stats[k] for k in ("batches", "rows", "largest_batch")},
                "load_average": [round(x, 2) for x in os.getloadavg()],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
