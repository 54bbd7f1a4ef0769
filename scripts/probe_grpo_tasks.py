"""Measure candidate tasks for the GRPO example on `checkpoints/chat` (a throwaway probe).

Usage (from the repository root):

    python scripts/probe_grpo_tasks.py RUN_DIR [TASK ...] [--prompts 100] [--group 8]
    python scripts/probe_grpo_tasks.py RUN_DIR file --file data/grpo-val.jsonl --prompts 200

For each candidate task, on `--prompts` held-out prompts (words and names of the held-out fifth
that `scripts/make_chat.py` sets aside, or words no chat row holds at all): the greedy pass@1, and
for each sampling setting (temperature 0.8 / 1.0 / 1.2, top_k none or 10) the mean per-sample
success rate and pass@group (the share of prompts with at least one exact reply among `--group`
samples). A reply is the text before the first chat token (`<|end|>` or a role marker) within
the answer's length + `MARGIN` tokens, and succeeds when it ended there and equals the answer
after stripping (the `exact` verifier). One JSON line per task and setting on stdout, with
`groups_with_variance`: the share of prompts whose samples got both rewards (GRPO's signal).
With `--file`, the task `file` is the first `--prompts` rows of a `scripts/make_prompts.py` file.
The figures that chose the GRPO task are in `data/README.md` (`grpo-train.jsonl`).
"""

import argparse
import json
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from make_chat import MIN_COUNT, SEED, held_out  # noqa: E402

from llmcli.config.sample import SampleConfig  # noqa: E402
from llmcli.data.chat_template import require_run_template  # noqa: E402
from llmcli.data.conversations import ConversationEncoder  # noqa: E402
from llmcli.generation.chat import reply_stop_ids  # noqa: E402
from llmcli.generation.engine import generate  # noqa: E402
from llmcli.generation.fast_decode import FastDecoder  # noqa: E402
from llmcli.runs.loading import load_run  # noqa: E402

MARGIN = 4
SHOUT = [{"role": "system", "content": "Shout."}]
SETTINGS = [(t, k) for t in (0.8, 1.0, 1.2) for k in (None, 10)]


def user(text, system=()):
    return [*system, {"role": "user", "content": text}]


def vocab(text):
    """Held-out words and names (make_chat's split), and the words and names no chat row has."""
    (_, val_w), (_, val_n) = held_out(text, random.Random(SEED))
    counts = Counter(re.findall(r"\b[a-z]{8,11}\b", text))
    long_words = sorted(w for w, n in counts.items() if n >= MIN_COUNT)
    speakers = Counter(re.findall(r"^([A-Z]{8,10})\.$", text, flags=re.MULTILINE))
    long_names = sorted(s.capitalize() for s, n in speakers.items() if n >= MIN_COUNT)
    names5 = sorted(s.capitalize() for s, n in speakers.items() if n >= 5)
    return val_w, val_n, long_words, long_names, names5


def thrice(w, system=(), case=str):
    return user(f"Say thrice: {w}", system), case(f"{w} {w} {w}")


def twice(w, system=(), case=str):
    return user(f"Say twice: {w}", system), case(f"{w} {w}")


def spell(w):
    return user(f"Spell {w}."), "-".join(w)


def greet(n, system=(), case=str):
    return user(f"I am {n}.", system), case(f"Good morrow, {n}!")


def thrice_demo(d, w):
    demo = [
        {"role": "user", "content": f"Say thrice: {d}"},
        {"role": "assistant", "content": f"{d} {d} {d}"},
    ]
    return [*demo, *user(f"Say thrice: {w}")], f"{w} {w} {w}"


def tasks(text):
    """Each candidate task: a function of a `random.Random` to (messages, answer)."""
    val_w, val_n, long_words, long_names, names5 = vocab(text)
    short = [w for w in val_w if len(w) <= 4]
    up = str.upper

    def sized(items, n):
        return [x for x in items if len(x) == n]

    pick = {
        "thrice": (thrice, [val_w]),
        "thrice_shout": (lambda w: thrice(w, SHOUT, up), [val_w]),
        "twice_shout": (lambda w: twice(w, SHOUT, up), [val_w]),
        "once": (lambda w: (user(f"Say once: {w}"), w), [val_w]),
        "say_w": (lambda w: (user(f"Say {w}."), w), [val_w]),
        "spell7": (spell, [sized(val_w, 7)]),
        "spell_long": (spell, [long_words]),
        "spell_name": (spell, [val_n]),
        "greet_heldout": (greet, [val_n]),
        "greet_long": (greet, [long_names]),
        "greet_word": (lambda w: greet(w.capitalize()), [val_w]),
        "twice_two": (lambda a, b: twice(f"{a} {b}"), [val_w, val_w]),
        "twice_name": (twice, [val_n]),
        "thrice_name": (thrice, [val_n]),
        "greet_8": (greet, [sized(names5, 8)]),
        "greet_9": (greet, [sized(names5, 9)]),
        "greet_10": (greet, [sized(names5, 10)]),
        "greet_long_shout": (lambda n: greet(n, SHOUT, up), [long_names]),
        "twice_8": (twice, [sized(long_words, 8)]),
        "twice_9": (twice, [sized(long_words, 9)]),
        "spell_8": (spell, [sized(long_words, 8)]),
        "thrice_short": (thrice, [short]),
        "thrice_demo": (thrice_demo, [short, short]),
    }

    def maker(make, pools):
        return lambda rng: make(*(rng.choice(pool) for pool in pools))

    sizes = dict(val_w=len(val_w), val_n=len(val_n), long_words=len(long_words))
    sizes.update(long_names=len(long_names), names5=len(names5))
    return {name: maker(*entry) for name, entry in pick.items()}, sizes


def replies(model, encoder, stops, prompts, budget, config):
    """Each prompt's reply text and whether it ended with a chat token within `budget`."""
    config = SampleConfig(**{**config, "max_new_tokens": budget})
    out = [[] for _ in prompts]
    ended = [False] * len(prompts)
    decoder = FastDecoder.for_model(model)
    vocab_size = encoder.tokenizer.vocab_size
    for step in generate(model, prompts, config, decode=decoder, vocab_size=vocab_size):
        for b, token in enumerate(step.tolist()):
            if ended[b]:
                continue
            if token in stops:
                ended[b] = True
            else:
                out[b].append(token)
        if all(ended):
            break
    return [(encoder.tokenizer.decode(ids), e) for ids, e in zip(out, ended, strict=True)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("tasks", nargs="*")
    p.add_argument("--prompts", type=int, default=100)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--file", help="a prompts JSONL ({prompt, answer}) measured as the task 'file'")
    p.add_argument("--settings", default="all", help="all, or e.g. 1.0:none,1.0:10")
    a = p.parse_args()
    torch.manual_seed(0)
    text = Path("data/shakespeare.txt").read_text(encoding="utf-8")
    makers, sizes = tasks(text)
    print(json.dumps({"vocab": sizes}), flush=True)
    run = load_run(a.run_dir, device="cpu")
    model = run.model.eval()
    encoder = ConversationEncoder(require_run_template(run.run_dir), run.tokenizer)
    stops = set(reply_stop_ids(encoder))
    settings = (
        SETTINGS
        if a.settings == "all"
        else [
            (float(t), None if k == "none" else int(k))
            for t, k in (s.split(":") for s in a.settings.split(","))
        ]
    )
    if a.file:
        rows_in = [
            json.loads(line) for line in Path(a.file).read_text(encoding="utf-8").splitlines()
        ]
        makers["file"] = lambda r: (lambda x: (x["prompt"], x["answer"]))(rows_in.pop(0))
    for name in a.tasks or list(makers):
        rng = random.Random(1)
        rows = [makers[name](rng) for _ in range(a.prompts)]
        prompts = [encoder.prompt(m) for m, _ in rows]
        answers = [ans for _, ans in rows]
        budget = max(len(encoder.tokenizer.encode(x)) for x in answers) + MARGIN
        t0 = time.time()
        greedy = replies(model, encoder, stops, prompts, budget, dict(temperature=0.0))
        ok = [
            e and got.strip() == ans.strip() for (got, e), ans in zip(greedy, answers, strict=True)
        ]
        if a.file:
            by = {}
            for (m, ans), k in zip(rows, ok, strict=True):
                key = f"{'shout' if len(m) > 1 else 'plain'}-{len(ans) - 14}"
                by.setdefault(key, []).append(k)
            print(
                json.dumps(
                    {
                        "greedy_by": {
                            k: [round(sum(v) / len(v), 2), len(v)] for k, v in sorted(by.items())
                        }
                    }
                )
            )
        wrong = [
            (m[-1]["content"], got)
            for (m, _), (got, _), k in zip(rows, greedy, ok, strict=True)
            if not k
        ][:3]
        print(
            json.dumps(
                {
                    "task": name,
                    "greedy": sum(ok) / len(ok),
                    "example": rows[0][0][-1]["content"] + " -> " + answers[0],
                    "greedy_wrong": wrong,
                    "s": round(time.time() - t0, 1),
                }
            ),
            flush=True,
        )
        for temp, k in settings:
            t0 = time.time()
            big = [pr for pr in prompts for _ in range(a.group)]
            got = replies(
                model, encoder, stops, big, budget, dict(temperature=temp, top_k=k, seed=1000)
            )
            hits = [
                e and g.strip() == answers[i // a.group].strip() for i, (g, e) in enumerate(got)
            ]
            per_prompt = [sum(hits[i * a.group : (i + 1) * a.group]) for i in range(len(prompts))]
            varied = sum(0 < h < a.group for h in per_prompt) / len(prompts)
            print(
                json.dumps(
                    {
                        "task": name,
                        "temperature": temp,
                        "top_k": k,
                        "sample_success": round(sum(hits) / len(hits), 3),
                        f"pass@{a.group}": round(sum(h > 0 for h in per_prompt) / len(prompts), 3),
                        "groups_with_variance": round(varied, 3),
                        "samples": [g for g, _ in got[:3]],
                        "s": round(time.time() - t0, 1),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
