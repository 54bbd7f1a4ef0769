"""Generate `data/repeats.txt`: lines of random letters, each written twice.

Usage (from the repository root):

    python scripts/make_repeats.py data/repeats.txt

Each line is n distinct lowercase letters drawn at random (n from 4 to 16, uniform), written
twice with nothing between, then a newline: `qwhzkqwhzk`. The first copy is noise; the second
can only be predicted by copying it from the first, which is what an induction head does, so a
small model trained on it shows the induction-head phase change within a minute or two on a CPU
(`configs/induction.yaml`). Deterministic: Python's `random.Random(SEED)`, `SIZE` bytes.
"""

import random
import string
import sys
from pathlib import Path

SEED = 0
SIZE = 400_000  # bytes, about 21,000 lines
SHORTEST, LONGEST = 4, 16  # letters in a copy: two copies of the longest fill a 32-token context


def make(seed: int = SEED, size: int = SIZE) -> str:
    rng = random.Random(seed)
    lines, total = [], 0
    while total < size:
        letters = "".join(rng.sample(string.ascii_lowercase, rng.randint(SHORTEST, LONGEST)))
        lines.append(letters * 2 + "\n")
        total += len(lines[-1])
    return "".join(lines)


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(make(), encoding="utf-8")
