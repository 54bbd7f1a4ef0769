"""Generate `data/grpo-train.jsonl` and `data/grpo-val.jsonl`: prompts with verifiable answers,
for GRPO from `checkpoints/chat`.

Usage (from the repository root):

    python scripts/make_prompts.py data/shakespeare.txt data/

Every row is a prompt (the chat messages, ending with the user's turn) and the one reply that
earns the reward, checked by the `exact` verifier (the reply, stripped, equals the answer):

    {"prompt": [{"role": "user", "content": "I am Desdemona."}],
     "answer": "Good morrow, Desdemona!"}

and, with the system message `Shout.` (a fifth of the rows, as in the chat data), the answer in
capitals (`GOOD MORROW, DESDEMONA!`).

The task is the chat example's greeting, `I am Romeo.` -> `Good morrow, Romeo!`, for the
plays' longer names. The chat data (`scripts/make_chat.py`) greets only names of 4 to 7 letters,
and the chat run greets held-out names of those lengths right 98% of the time; names of 8 to 10
letters it garbles when it copies them (`Good morrow, Cardinala!`, `Good morrow, Wincest!`).
Greedy, it greets about a third of them right (8 letters: two thirds, 9: one in twenty, 10:
none); sampled at temperature 1, about one greeting in four is right and about half the names
get at least one right greeting among 8 samples, so most groups of samples hold both rewards,
the variance GRPO learns from. `scripts/probe_grpo_tasks.py` measured this and the other candidates
(`Say thrice: hark`, which the chat run never says right even sampled, among them).

Half the training rows (`KEEP`) ask the chat data's own tasks instead, on its training words
and names (a short name's greeting, a spelling, a word said twice), which the chat run already
answers: their groups mostly earn the same reward and teach nothing, until training on long
names starts to change those answers too (a first run on long names alone learned to lengthen
every name, `Good morrow, Dolll!`, and its chat exact match fell from 98.5% to 79.6%); then
their rewards differ and pull the answers back.

Names: the speakers' names of 8 to 10 letters (`DESDEMONA.` alone on a line, at least
`MIN_COUNT` times), written `Desdemona`; none is a name of the chat data. They are split before
any row is made, as `make_chat.py` splits its names (`split`: a shuffled fifth held out): a
validation row uses only names that no training row holds. Deterministic: sorted lists,
`random.Random(SEED)`.
"""

import random
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from make_chat import SEED, SHOUT, held_out, split, turn, write

TRAIN_ROWS, VAL_ROWS = 2000, 200
MIN_COUNT = 5  # a speaker's lines: 175 names of 8 to 10 letters (98 at make_chat's 20)
KEEP = 0.5  # the share of training rows that ask the chat data's own tasks


def long_names(text: str) -> list[str]:
    """The plays' speakers' names of 8 to 10 letters, sorted."""
    speakers = re.findall(r"^([A-Z]{8,10})\.$", text, flags=re.MULTILINE)
    return sorted({s.capitalize() for s, n in Counter(speakers).items() if n >= MIN_COUNT})


def row(names: list[str], rng: random.Random) -> dict:
    """One prompt and its answer."""
    shout = rng.random() < SHOUT
    name = rng.choice(names)
    system = [{"role": "system", "content": "Shout."}] if shout else []
    answer = f"Good morrow, {name}!"
    return {
        "prompt": [*system, {"role": "user", "content": f"I am {name}."}],
        "answer": answer.upper() if shout else answer,
    }


def chat_row(words: list[str], names: list[str], rng: random.Random) -> dict:
    """One of the chat data's own tasks (a short name's greeting, a spelling, a word said
    twice) on its training words and names, as a prompt and its answer."""
    shout = rng.random() < SHOUT
    question, answer = turn(words, names, rng)
    system = [{"role": "system", "content": "Shout."}] if shout else []
    return {
        "prompt": [*system, {"role": "user", "content": question}],
        "answer": answer.upper() if shout else answer,
    }


def mixed(
    text: str, items: list[str], task_row: Callable, seed: int = SEED
) -> tuple[list[dict], list[dict]]:
    """A task's prompts on `items` (`task_row(items, rng)`), split into held-out and training
    items; the training rows mixed with the chat data's own tasks (`KEEP` of them)."""
    rng = random.Random(seed)
    train_items, val_items = split(items, rng)
    (chat_words, _), (chat_names, _) = held_out(text, random.Random(SEED))
    train = [
        chat_row(chat_words, chat_names, rng) if rng.random() < KEEP else task_row(train_items, rng)
        for _ in range(TRAIN_ROWS)
    ]
    val = [task_row(val_items, rng) for _ in range(VAL_ROWS)]
    return train, val


def make(text: str, seed: int = SEED) -> tuple[list[dict], list[dict]]:
    return mixed(text, long_names(text), row, seed)


if __name__ == "__main__":
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    train, val = make(source.read_text(encoding="utf-8"))
    write(train, out / "grpo-train.jsonl")
    write(val, out / "grpo-val.jsonl")
