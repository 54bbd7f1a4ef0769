"""`llmcli eval --data conversations.jsonl` on a chat run (llmcli/evaluation/chat.py).

References: the ids and the mask are spelled out by hand from the built-in template (the chat
tokenizer has one token per character), the loss is `F.cross_entropy` over the masked targets
of one conversation at a time, and the replies come from a plain argmax loop over the model's
forward (no cache, no batching).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chat_helpers import CONVERSATIONS, chat_tokenizer, save_chat_run
from conftest import save_tiny_run
from hf_helpers import greedy_llmcli

from llmcli.cli import main
from llmcli.config import load_config
from llmcli.data.chat_template import END_OF_TURN, ROLE_TOKENS, default_template
from llmcli.data.tokenizer import CharTokenizer
from llmcli.runs.directory import save_model_run
from llmcli.runs.loading import load_run

pytestmark = pytest.mark.usefixtures("one_thread")

MORE = [  # a third conversation: three assistant turns, one reply repeated
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "Spell cat."},
    {"role": "assistant", "content": "c-a-t"},
    {"role": "user", "content": "Again?"},
    {"role": "assistant", "content": "c-a-t"},
]


def cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def run_eval(capsys, run_dir: Path, data: Path, *options) -> tuple[int, str, str]:
    return cli(capsys, "eval", "--checkpoint", run_dir, "--data", data, "--no-progress", *options)


def write_jsonl(path: Path, conversations: list) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def hand_tokens(messages, generation_prompt: bool = False) -> tuple[list[str], list[bool]]:
    """The built-in template's tokens, by hand: a role token, a newline, the content's
    characters, `<|end|>`, a newline per message; True on an assistant's content and `<|end|>`."""
    tokens, mask = [], []
    for m in messages:
        writes = m["role"] == "assistant"
        tokens += [ROLE_TOKENS[m["role"]], "\n", *m["content"], END_OF_TURN, "\n"]
        mask += [False, False] + [writes] * (len(m["content"]) + 1) + [False]
    if generation_prompt:
        tokens += [ROLE_TOKENS["assistant"], "\n"]
        mask += [False, False]
    return tokens, mask


def ids_of(run, tokens: list[str]) -> list[int]:
    return [run.tokenizer.hf.token_to_id(t) for t in tokens]


def hand_loss(run, messages) -> tuple[int, float]:
    """(assistant tokens, their summed nats) of one conversation: target t+1 kept when mask[t+1]."""
    tokens, mask = hand_tokens(messages)
    ids = torch.tensor(ids_of(run, tokens))
    with torch.no_grad():
        logits, _ = run.model(ids[None, :-1])  # (1, N-1, V)
    nll = F.cross_entropy(logits[0].double(), ids[1:], reduction="none")
    keep = torch.tensor(mask[1:])
    return int(keep.sum()), float(nll[keep].sum())


def test_assistant_loss_equals_cross_entropy_over_the_hand_masked_targets(tmp_path, capsys):
    run_dir = save_chat_run(tmp_path / "run")
    data = write_jsonl(tmp_path / "chat.jsonl", [*CONVERSATIONS, MORE])
    # Batches of two: a padded batch, then one conversation alone.
    code, out, err = run_eval(capsys, run_dir, data, "--json", "--batch-size", 2)
    assert code == 0, err
    result = json.loads(out)
    run = load_run(run_dir)
    hand = [hand_loss(run, c) for c in [*CONVERSATIONS, MORE]]
    assert [c["tokens"] for c in result["per_conversation"]] == [n for n, _ in hand]
    assert [n for n, _ in hand] == [4, 12, 16]  # "Hi!<|end|>" 4, "c-a-t<|end|>" 6, ...
    for got, (n, nats) in zip(result["per_conversation"], hand, strict=True):
        assert got["loss"] == pytest.approx(nats / n, rel=1e-5)
    assert result["tokens"] == sum(n for n, _ in hand)
    assert result["loss"] == pytest.approx(sum(s for _, s in hand) / result["tokens"], rel=1e-5)
    assert result["perplexity"] == pytest.approx(np.exp(result["loss"]), rel=1e-9)
    assert (result["conversations"], result["truncated"], result["skipped"]) == (3, 0, 0)
    assert "answers" not in result

    code, out, _ = run_eval(capsys, run_dir, data)
    assert code == 0
    assert f"assistant loss {result['loss']:.4f} nats/token" in out
    assert "3 conversations" in out and f"{result['tokens']} assistant tokens" in out

    # Plain text on a chat run is scored as text, every token.
    text = tmp_path / "text.txt"
    text.write_text("Hello there. Spell cat.\n" * 3)
    code, out, err = run_eval(capsys, run_dir, text, "--json")
    assert code == 0, err
    assert json.loads(out)["tokens"] == len("Hello there. Spell cat.\n" * 3) - 1


def test_too_long_conversations_are_cut_at_a_turn_boundary_or_skipped(tmp_path, capsys):
    """Context 24 (a window of 25 tokens): the first conversation (29 tokens by hand, its only
    assistant turn ending at the 28th) is skipped; the second keeps its first exchange (up to
    its first `<|end|>`, the 22nd of 23 tokens), as training cuts them."""
    run_dir = save_chat_run(tmp_path / "run", context_length=24)
    data = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    assert len(hand_tokens(CONVERSATIONS[0])[0]) == 29
    assert len(hand_tokens(CONVERSATIONS[1][:2])[0]) == 23
    code, out, err = run_eval(capsys, run_dir, data, "--json", "--answers")
    assert code == 0, err
    result = json.loads(out)
    assert (result["skipped"], result["skipped_at"]) == (1, [f"{data} line 1"])
    assert (result["conversations"], result["truncated"]) == (1, 1)
    [scored] = result["per_conversation"]
    assert (scored["where"], scored["messages"], scored["truncated"]) == (f"{data} line 2", 2, True)
    n, nats = hand_loss(load_run(run_dir), CONVERSATIONS[1][:2])
    assert (scored["tokens"], scored["loss"]) == (n, pytest.approx(nats / n, rel=1e-5))
    assert [(a["where"], a["turn"]) for a in result["answers"]] == [(f"{data} line 2", 1)]


def test_without_data_a_chat_run_scores_its_validation_conversations(tmp_path, capsys):
    """The validation split, rebuilt from the run's config, scores as its file does."""
    train = write_jsonl(tmp_path / "train.jsonl", CONVERSATIONS * 2)
    val = write_jsonl(tmp_path / "val.jsonl", [MORE, *CONVERSATIONS])
    data = {"format": "chat", "path": str(train), "val_path": str(val)}
    raw = {"model": {"n_layer": 2, "n_head": 2, "n_embed": 32, "context_length": 24}}
    raw["data"] = {**data, "cache_dir": str(tmp_path / "cache")}
    run_dir = save_tiny_run(tmp_path / "run", chat_tokenizer(), raw, sharpen=3.0)
    default_template().save(run_dir)
    code, out, err = cli(capsys, "eval", "--checkpoint", run_dir, "--json", "--no-progress")
    assert code == 0, err
    split = json.loads(out)
    code, out, err = run_eval(capsys, run_dir, val, "--json")
    assert code == 0, err
    file = json.loads(out)
    assert split["data"] == f"validation split of {val}"
    for key in ("conversations", "truncated", "skipped", "tokens"):
        assert split[key] == file[key], key
    assert (file["truncated"], file["skipped"]) == (2, 1)  # context 24: see the test above
    assert split["loss"] == pytest.approx(file["loss"], rel=1e-6)
    # --answers needs the turns as written: they are read from the run's data.val_path file.
    code, out, err = cli(capsys, "eval", "--checkpoint", run_dir, "--answers", "--json")
    assert code == 0, err
    code, given, err = run_eval(capsys, run_dir, val, "--answers", "--json")
    assert json.loads(out)["answers"] == json.loads(given)["answers"]
    assert json.loads(out)["data"] == str(val)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A chat run fine-tuned by hand until it repeats the sample conversations' replies."""
    run_dir = save_chat_run(tmp_path_factory.mktemp("trained") / "run")
    run = load_run(run_dir)
    model = run.model.train()
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    examples = []
    for messages in CONVERSATIONS:
        tokens, mask = hand_tokens(messages)
        examples.append((torch.tensor(ids_of(run, tokens)), torch.tensor(mask)))
    for _ in range(100):
        loss = 0.0
        for ids, mask in examples:
            logits, _ = model(ids[None, :-1])
            nll = F.cross_entropy(logits[0], ids[1:], reduction="none")
            loss = loss + nll[mask[1:]].mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    save_model_run(run_dir, run.config, run.tokenizer, model.eval())
    return run_dir


def hand_answer(run, before, expected: str) -> tuple[str, bool]:
    """A plain greedy loop over the prompt built by hand: the reply's text and whether it is
    `expected`, ended by `<|end|>` within len(expected) + 8 tokens."""
    prompt = ids_of(run, hand_tokens(before, generation_prompt=True)[0])
    end_id = run.tokenizer.hf.token_to_id(END_OF_TURN)
    new = greedy_llmcli(run.model, prompt, len(expected) + 8)
    reply = new[: new.index(end_id)] if end_id in new else new
    got = run.tokenizer.decode(reply)
    return got, end_id in new and got == expected


def test_exact_matches_equal_a_hand_greedy_loop(trained_run, tmp_path, capsys):
    wrong = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Bye"}]
    spaced = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! "}]
    conversations = [*CONVERSATIONS, wrong, spaced, MORE]
    data = write_jsonl(tmp_path / "chat.jsonl", conversations)
    code, out, err = run_eval(capsys, trained_run, data, "--json", "--answers", "--batch-size", 3)
    assert code == 0, err
    result = json.loads(out)
    run = load_run(trained_run)
    expected = []
    for line, messages in enumerate(conversations, start=1):
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                got, match = hand_answer(run, messages[:i], m["content"])
                where, want = f"{data} line {line}", m["content"]
                expected.append(
                    {"where": where, "turn": i, "expected": want, "got": got, "match": match}
                )
    assert result["answers"] == expected
    assert result["matches"] == sum(a["match"] for a in expected)
    assert result["turns"] == len(expected) == 8
    # The replies it learnt match; "Bye" and "Hi! " (exact: whitespace counts) do not.
    assert [a["match"] for a in expected[:5]] == [True, True, True, False, False]
    assert result["exact_match"] == pytest.approx(result["matches"] / 8)

    code, out, _ = run_eval(capsys, trained_run, data, "--answers")
    assert code == 0
    assert f"answers: {result['matches']} of 8 greedy replies exact" in out


def test_bad_input_exits_2_naming_what_to_fix(tmp_path, capsys, monkeypatch):
    run_dir = save_chat_run(tmp_path / "run")
    before = sorted(p.name for p in run_dir.iterdir())
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + '\n{"messages": [\n')
    code, _, err = run_eval(capsys, run_dir, bad)
    assert code == 2 and f"{bad} line 2 is not JSON" in err and "Traceback" not in err

    chars = CharTokenizer("".join(sorted(set("Hello world.\n"))))
    text_run = save_tiny_run(tmp_path / "text", chars, {"model": {"context_length": 16}})
    text = tmp_path / "text.txt"
    text.write_text("Hello world.\n" * 4)
    code, _, err = run_eval(capsys, text_run, text, "--answers")
    assert code == 2 and "--answers" in err and "--data FILE.jsonl" in err
    code, _, err = cli(capsys, "eval", "--checkpoint", run_dir, "--answers")
    assert code == 2 and "--answers" in err  # a chat run's validation text is no conversation
    good = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    code, _, err = run_eval(capsys, text_run, good, "--answers")
    assert code == 2 and "has no chat template" in err and "train.init_from" in err
    # The command it suggests works from any folder: it names the shipped config, no path.
    name, init = re.search(r"`llmcli train (\S+) --set (train\.init_from=\S+)`", err).groups()
    with monkeypatch.context() as m:
        m.chdir(tmp_path)
        config = load_config(name, [init])
    assert config.data.format == "chat" and config.train.init_from == str(text_run)
    code, _, err = run_eval(capsys, run_dir, good, "--per-token")
    assert code == 2 and "--per-token scores text windows" in err
    code, _, err = run_eval(capsys, run_dir, good, "--ablate-feature", f"{tmp_path}/sae:1")
    assert code == 2 and "--ablate-feature scores text windows" in err  # before any SAE is read
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing written
