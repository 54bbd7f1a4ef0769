"""Generate `data/grpo-twice-train.jsonl` and `data/grpo-twice-val.jsonl`: prompts with answers
for GRPO on a task the shipped example was not tuned on, saying twice words longer than any the
chat data says twice.

Usage (from the repository root):

    python scripts/make_twice_prompts.py data/shakespeare.txt data/

Every row is `{"prompt": [...], "answer": ...}`: `Say twice: remembrance` -> `remembrance
remembrance`, with the system message `Shout.` a fifth of the time (the answer then in
capitals). The chat data says twice words of 3 to 7 letters, and the chat run cuts or garbles
longer ones (3.5% of the validation prompts right greedily); these are the plays' words of 8 to
11 letters seen at least `MIN_COUNT` times, none of them a word of the chat data. (Spelling the
same words, `w-o-r-d`, was the first candidate: the chat run stops every spelling by its seventh
letter, so no sampled reply is ever right and GRPO has nothing to learn from.) As in
`make_prompts.py`, half the training rows ask the chat data's own tasks on its training words and
names (their answers keep what the run knows in place), and the words are split before any row is
made: a validation row asks only for words that no training row holds. Deterministic: sorted
lists, `random.Random(SEED)`.
"""

import random
import re
import sys
from collections import Counter
from pathlib import Path

from make_chat import SEED, SHOUT, write
from make_prompts import mixed

TRAIN_ROWS, VAL_ROWS = 2000, 200
MIN_COUNT = 5


def long_words(text: str) -> list[str]:
    """The plays' lowercase words of 8 to 11 letters seen at least `MIN_COUNT` times, sorted."""
    counts = Counter(re.findall(r"\b[a-z]{8,11}\b", text))
    return sorted(w for w, n in counts.items() if n >= MIN_COUNT)


def row(words: list[str], rng: random.Random) -> dict:
    """One prompt and its answer."""
    shout = rng.random() < SHOUT
    word = rng.choice(words)
    system = [{"role": "system", "content": "Shout."}] if shout else []
    answer = f"{word} {word}"
    return {
        "prompt": [*system, {"role": "user", "content": f"Say twice: {word}"}],
        "answer": answer.upper() if shout else answer,
    }


def make(text: str, seed: int = SEED) -> tuple[list[dict], list[dict]]:
    return mixed(text, long_words(text), row, seed)


if __name__ == "__main__":
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    train, val = make(source.read_text(encoding="utf-8"))
    write(train, out / "grpo-twice-train.jsonl")
    write(val, out / "grpo-twice-val.jsonl")
