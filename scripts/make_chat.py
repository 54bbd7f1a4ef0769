"""Generate `data/chat-train.jsonl` and `data/chat-val.jsonl`: short conversations a small
character-level model learns to answer, with held-out words for the validation split.

Usage (from the repository root):

    python scripts/make_chat.py data/shakespeare.txt data/

Every row is `{"messages": [...]}` with one or two user turns, each answered by the assistant
with one of three small tasks on a word of the plays:

| user | assistant |
| --- | --- |
| `I am Romeo.` | `Good morrow, Romeo!` |
| `Spell love.` | `l-o-v-e` |
| `Say twice: hark` | `hark hark` |

and, with the system message `Shout.`, the same reply in capitals (`GOOD MORROW, ROMEO!`).
Answering is copying what the user wrote, letter by letter, through a fixed frame: what an
induction head does, so a 4-layer model of 0.8M parameters learns it in minutes. The words are
split before any conversation is made: a validation conversation uses only words (and names)
that no training conversation holds, so its exact-match rate measures the skill, not memory.

Words: the lowercase words of 3 to 7 letters that occur at least 20 times in
`data/shakespeare.txt`; names: the speakers' names of 4 to 7 letters (`ROMEO.` alone on a line,
at least 20 times), written `Romeo`. Deterministic: sorted lists, `random.Random(SEED)`.
"""

import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

SEED = 0
TRAIN_ROWS, VAL_ROWS = 6000, 300
HELD_OUT = 0.2  # the share of words and names kept for the validation split
TWO_TURNS = 0.25  # the share of conversations with a second user turn
SHOUT = 0.2  # the share of conversations under the system message "Shout."
MIN_COUNT = 20


def vocabulary(text: str) -> tuple[list[str], list[str]]:
    """The plays' common short words and their speakers' names, each sorted."""
    counts = Counter(re.findall(r"\b[a-z]{3,7}\b", text))
    words = sorted(w for w, n in counts.items() if n >= MIN_COUNT)
    speakers = re.findall(r"^([A-Z]{4,7})\.$", text, flags=re.MULTILINE)
    names = sorted({s.capitalize() for s, n in Counter(speakers).items() if n >= MIN_COUNT})
    return words, names


def split(items: list[str], rng: random.Random) -> tuple[list[str], list[str]]:
    """(training, held-out) items: a shuffled copy cut at `HELD_OUT`."""
    items = items[:]
    rng.shuffle(items)
    cut = int(len(items) * HELD_OUT)
    return sorted(items[cut:]), sorted(items[:cut])


def turn(words: list[str], names: list[str], rng: random.Random) -> tuple[str, str]:
    """One question and its answer."""
    task = rng.randrange(3)
    if task == 0:
        name = rng.choice(names)
        return f"I am {name}.", f"Good morrow, {name}!"
    word = rng.choice(words)
    if task == 1:
        return f"Spell {word}.", "-".join(word)
    return f"Say twice: {word}", f"{word} {word}"


def conversation(words: list[str], names: list[str], rng: random.Random) -> dict:
    shout = rng.random() < SHOUT
    messages = [{"role": "system", "content": "Shout."}] if shout else []
    for _ in range(2 if rng.random() < TWO_TURNS else 1):
        question, answer = turn(words, names, rng)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer.upper() if shout else answer})
    return {"messages": messages}


def held_out(text: str, rng: random.Random) -> tuple[tuple[list[str], list[str]], ...]:
    """((training words, held-out words), (training names, held-out names)) of `text`: the
    split every generated set on these words shares (`random.Random(SEED)` fresh)."""
    words, names = vocabulary(text)
    return split(words, rng), split(names, rng)


def make(text: str, seed: int = SEED) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    (train_words, val_words), (train_names, val_names) = held_out(text, rng)
    train = [conversation(train_words, train_names, rng) for _ in range(TRAIN_ROWS)]
    val = [conversation(val_words, val_names, rng) for _ in range(VAL_ROWS)]
    return train, val


def write(rows: list[dict], path: Path) -> None:
    lines = [json.dumps(row, ensure_ascii=False) + "\n" for row in rows]
    path.write_text("".join(lines), encoding="utf-8")


if __name__ == "__main__":
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    train, val = make(source.read_text(encoding="utf-8"))
    write(train, out / "chat-train.jsonl")
    write(val, out / "chat-val.jsonl")
