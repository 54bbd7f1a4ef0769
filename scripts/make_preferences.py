"""Generate `data/dpo-train.jsonl`, `data/dpo-val.jsonl` and `data/dpo-val-chosen.jsonl`:
preference pairs on the chat example's words, for DPO from `checkpoints/chat`.

Usage (from the repository root):

    python scripts/make_preferences.py data/shakespeare.txt data/

Every row is a pair in TRL's conversational shape, `{"prompt": [...], "chosen": [{"role":
"assistant", ...}], "rejected": [{"role": "assistant", ...}]}`, the prompt ending with the user's
turn:

| share | user | chosen | rejected |
| --- | --- | --- | --- |
| 1/2 | `Say thrice: hark` | `hark hark hark` | `hark hark` |
| 1/4 | `Say twice: hark` | `hark hark` | `hark` |
| 1/4 | `Spell love.` | `l-o-v-e` | `l-o-v` |

and, with the system message `Shout.` (a fifth of the rows), the same in capitals. The chat data
(`scripts/make_chat.py`) never says "thrice": asked to, the chat run says the word twice, the
rejected reply here. The preference teaches an instruction the fine-tune never taught, so the
held-out figures can see it move; the say-twice and spelling pairs keep those answers in the
loss, so that saying more does not leak into them unseen.

Every rejected reply is its chosen reply cut short. DPO lowers a rejected reply's
log-probability wherever it can, and a small model does it most cheaply by spoiling the tokens
after the point where the replies part (the rest of a name, the letters of a word); a reply cut
short has no tokens there, only an end of turn that came too early.

A quarter of the prompts have an earlier exchange (one of the chat example's questions and its
answer), as the chat run is asked in turns. Every pair fits the chat run's 64-token context with
the built-in template (`fits`), so none is cut.

The words are split as `scripts/make_chat.py` splits them (`held_out`, the same seed): the
validation pairs use only words and names that no chat or preference training row holds.
`dpo-val-chosen.jsonl` is each validation pair's prompt and chosen reply as a chat conversation,
for `llmcli eval --answers`: how many greedy replies are the preferred ones.
"""

import random
import sys
from pathlib import Path

from make_chat import SEED, SHOUT, TWO_TURNS, held_out, turn, write

TRAIN_PAIRS, VAL_PAIRS = 2000, 200
TRIES = 20  # draws of an earlier exchange that fits, before a pair goes without one
CONTEXT = 64  # the chat run's model.context_length: a pair's sequences fit CONTEXT + 1 tokens


def question(words: list[str], rng: random.Random) -> tuple[str, str, str]:
    """A question, its chosen reply and its rejected one (the chosen cut short)."""
    word, kind = rng.choice(words), rng.random()
    if kind < 1 / 2:
        return f"Say thrice: {word}", f"{word} {word} {word}", f"{word} {word}"
    if kind < 3 / 4:
        return f"Say twice: {word}", f"{word} {word}", word
    spelt = "-".join(word)
    return f"Spell {word}.", spelt, spelt[:-2]


def fits(prompt: list[dict], reply: str) -> bool:
    """Whether prompt + reply fits `CONTEXT + 1` tokens of the char model with the built-in
    template: a message is `<|role|>\\n` + its text + `<|end|>\\n` (each mark one token, 4 in
    all), the reply `<|assistant|>\\n` + its text + `<|end|>\\n`."""
    return sum(len(m["content"]) + 4 for m in prompt) + 4 + len(reply) <= CONTEXT + 1


def pair(words: list[str], names: list[str], rng: random.Random) -> dict:
    """One preference row. The question is drawn first, so the mix of questions is the table's;
    an earlier exchange is then drawn up to `TRIES` times to fit the context before the pair
    goes without one."""
    shout, two_turns = rng.random() < SHOUT, rng.random() < TWO_TURNS
    case = str.upper if shout else str
    asked, chosen, rejected = question(words, rng)
    system = [{"role": "system", "content": "Shout."}] if shout else []
    last = {"role": "user", "content": asked}
    prompt = [*system, last]  # one turn always fits
    for _ in range(TRIES if two_turns else 0):
        earlier, answer = turn(words, names, rng)
        history = [
            {"role": "user", "content": earlier},
            {"role": "assistant", "content": case(answer)},
        ]
        if fits([*system, *history, last], chosen):
            prompt = [*system, *history, last]
            break
    return {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": case(chosen)}],
        "rejected": [{"role": "assistant", "content": case(rejected)}],
    }


def make(text: str, seed: int = SEED) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    (train_words, val_words), (train_names, val_names) = held_out(text, rng)
    train = [pair(train_words, train_names, rng) for _ in range(TRAIN_PAIRS)]
    val = [pair(val_words, val_names, rng) for _ in range(VAL_PAIRS)]
    return train, val


def chosen_conversation(row: dict) -> dict:
    """A pair as the chat conversation that ends with its chosen reply."""
    return {"messages": [*row["prompt"], *row["chosen"]]}


if __name__ == "__main__":
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    train, val = make(source.read_text(encoding="utf-8"))
    write(train, out / "dpo-train.jsonl")
    write(val, out / "dpo-val.jsonl")
    write([chosen_conversation(row) for row in val], out / "dpo-val-chosen.jsonl")
