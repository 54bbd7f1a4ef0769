"""`llmcli prepare-data` on a large corpus: wall time, peak memory and the first progress line.

The corpus is generated (not read from the repository): words drawn from a Zipf distribution
over an open vocabulary, so that, as in real text, new words keep appearing as the corpus grows
(Heaps' law) and a tokenizer trainer that counts every word holds more the more it reads. It is
written once per size into `--work` and reused.

Each round runs `llmcli prepare-data` in a fresh process with a fresh token cache, byte-level BPE
at `--vocab`, and reports wall time, peak RSS of the process (`ru_maxrss` of the child) and the
seconds to its first line on stderr. `--baseline REV` runs the same command with the llmcli of
git revision REV (`git archive` into the work folder) as the peer, interleaved round by round.

    python benchmarks/prepare_scale.py --gib 1 --rounds 1 --baseline 89d20bc
    python benchmarks/prepare_scale.py --gib 4 --rounds 1          # the new code alone

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LETTERS = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", dtype=np.uint8)
# The Zipf exponent of word ranks: 1.3 gives about as many distinct words per GiB as English web
# text, whose BPE training held 3.4 GB for 1 GiB in the measurement this benchmark follows up
# (a lower exponent, a heavier tail of rare words, needs far more).
ZIPF_A = 1.3


def _word(rank: int) -> str:
    """Rank r's word: r written in base 26 with letters ordered by frequency (short words for
    common ranks)."""
    out = []
    while True:
        rank, digit = divmod(rank, 26)
        out.append(chr(LETTERS[digit]))
        if rank == 0:
            return "".join(out)


def make_corpus(path: Path, n_bytes: int, seed: int = 0) -> None:
    """Write about `n_bytes` of generated text: sentences of Zipf words, lines of them."""
    rng = np.random.default_rng(seed)
    table = [_word(r) for r in range(1 << 20)]
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < n_bytes:
            ranks = rng.zipf(ZIPF_A, size=2_000_000) - 1
            words = [table[r] if r < len(table) else _word(int(r)) for r in ranks]
            for i in range(0, len(words), 12):  # a sentence of 12 words, a line of 4 sentences
                words[i] = words[i].capitalize()
            text = " ".join(words).replace(" " + "e ", ". ")  # some sentence ends
            lines = [text[i : i + 300] for i in range(0, len(text), 300)]
            block = "\n".join(lines) + "\n"
            f.write(block)
            written += len(block)


def llmcli_at(rev: str, work: Path) -> Path:
    """A folder holding llmcli as it was at git revision `rev`."""
    folder = work / f"llmcli-{rev}"
    if not folder.exists():
        folder.mkdir()
        archive = subprocess.run(
            ["git", "archive", rev, "llmcli", "configs", "data/README.md"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def run_once(corpus: Path, vocab: int, code: Path, sample: str | None) -> dict:
    """One `llmcli prepare-data` in a fresh process and a fresh cache."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "big.yaml"
        data = {"path": str(corpus), "tokenizer": "bpe", "vocab_size": vocab}
        if sample is not None:  # "null": the whole corpus
            data["tokenizer_sample"] = None if sample == "null" else sample
        config.write_text(json.dumps({"data": data, "model": {"context_length": 64}}))
        env = {**os.environ, "PYTHONPATH": str(code), "LLMCLI_CACHE": str(Path(tmp) / "cache")}
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmcli", "prepare-data", str(config)],
            cwd=tmp,  # not a clone's root, whose llmcli/ would come before PYTHONPATH's
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        first, lines = None, []
        for line in proc.stderr:
            first = first or time.perf_counter() - start
            lines.append(line.rstrip())
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if status != 0:
            raise RuntimeError("\n".join(lines[-20:]))
    return {
        "wall_s": round(wall, 1),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),  # KiB on Linux
        "first_line_s": round(first, 2) if first else None,
        "stdout": out.strip().splitlines()[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="corpus size in GiB")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--baseline", help="git revision of the peer (omit: the new code alone)")
    parser.add_argument("--sample", help="data.tokenizer_sample for the new code (default: its)")
    parser.add_argument("--sides", default="new,baseline", help="which sides to run, in order")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "llmcli-scale")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.work / f"corpus-{args.gib:g}gib-zipf{ZIPF_A:g}.txt"
    if not corpus.exists():
        make_corpus(corpus, int(args.gib * 2**30))
    code = {"new": ROOT}
    if args.baseline:
        code["baseline"] = llmcli_at(args.baseline, args.work)
    sides = {name: code[name] for name in args.sides.split(",") if name in code}
    rounds = []
    for _ in range(args.rounds):
        for name, code in sides.items():
            sample = args.sample if name == "new" else None
            rounds.append({"side": name, **run_once(corpus, args.vocab, code, sample)})
            print(json.dumps(rounds[-1]), file=sys.stderr)
    result = {
        "corpus_bytes": corpus.stat().st_size,
        "vocab": args.vocab,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "load_before": os.getloadavg()[0],
        "rounds": rounds,
    }
    if len(sides) == 2:
        new = [r["wall_s"] for r in rounds if r["side"] == "new"]
        old = [r["wall_s"] for r in rounds if r["side"] == "baseline"]
        result["wall_new_over_baseline"] = round(float(np.median(new) / np.median(old)), 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
