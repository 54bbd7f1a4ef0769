"""`llmcli chat`: replies to a scripted stdin equal a hand-written greedy loop over the ids of the
built-in template, and the history is cut at turn boundaries by hand-counted token lengths."""

from __future__ import annotations

import io
import os
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from chat_helpers import CONVERSATIONS, chat_tokenizer, save_chat_run
from conftest import save_tiny_run
from terminal_helpers import ctrl_c_leaves_the_session_on

from llmcli.cli import main
from llmcli.data.chat_template import CHAT_TOKENS, default_template, require_run_template
from llmcli.data.conversations import ConversationEncoder
from llmcli.data.tokenizer import CharTokenizer
from llmcli.errors import InputError
from llmcli.generation.batching import SampleOptions
from llmcli.generation.chat import (
    escape,
    fit_history,
    new_session,
    respond,
    session_command,
)
from llmcli.generation.prompts import unescape
from llmcli.runs.loading import load_run

pytestmark = pytest.mark.usefixtures("one_thread")

# seed 6, sharpened: the untrained model's greedy reply to "Hello" holds a newline and ends with
# <|end|> within 20 tokens, and its reply to "Spell cat." runs to the limit: both endings.
MODEL_SEED = 6


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return save_chat_run(tmp_path_factory.mktemp("runs") / "chat", seed=MODEL_SEED, sharpen=8.0)


@pytest.fixture(scope="module")
def run(run_dir):
    return load_run(run_dir)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def greedy_reply(run, messages, max_new_tokens: int) -> tuple[str, bool]:
    """The reply by hand: the template's ids, the argmax of a full forward at each step, up to a
    chat token; its text, and whether a chat token ended it."""
    tokenizer = run.tokenizer
    ids = ConversationEncoder(default_template(), tokenizer).prompt(messages)
    stops = {tokenizer.hf.token_to_id(token) for token in CHAT_TOKENS} | {tokenizer.eot_id}
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits, _ = run.model(torch.tensor([ids + new]))
            token = int(logits[0, -1].argmax())
            if token in stops:
                return tokenizer.decode(new), True
            new.append(token)
    return tokenizer.decode(new), False


def chat_cli(capsys, monkeypatch, run_dir, lines, *options: str) -> tuple[int, list[str], str]:
    """Run `llmcli chat` on `lines` piped in: its exit status, replies (unescaped) and stderr."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    with pytest.raises(SystemExit) as exc:
        main(["chat", "--checkpoint", str(run_dir), *options])
    out = capsys.readouterr()
    return exc.value.code, [unescape(line) for line in out.out.splitlines()], out.err


GREEDY = ("--temperature", "0", "--max-new-tokens", "20")


def test_replies_equal_a_greedy_loop_and_commands_change_the_history(
    run, run_dir, capsys, monkeypatch
) -> None:
    script = [
        "Hello",
        "Spell cat.",
        "/reset",
        "/system Be brief.",
        "/bogus",  # a hint, and the session goes on
        "Hello",
        "/system",  # no system message any more; the turns stay
        "Bye",
    ]
    code, replies, err = chat_cli(capsys, monkeypatch, run_dir, script, *GREEDY)
    assert code == 0, err
    first, stopped = greedy_reply(run, [user("Hello")], 20)
    assert stopped and "\n" in first  # the fixture's model: a multi-line reply that ends itself
    second, stopped = greedy_reply(run, [user("Hello"), assistant(first), user("Spell cat.")], 20)
    assert not stopped
    system = {"role": "system", "content": "Be brief."}
    third, _ = greedy_reply(run, [system, user("Hello")], 20)
    fourth, _ = greedy_reply(run, [user("Hello"), assistant(third), user("Bye")], 20)
    assert replies == [first, second, third, fourth]
    assert "unknown command /bogus" in err and "/help" in err
    # The quit lines of `sample --interactive`; a near miss of a command is named.
    for quit_line in ("/quit", "/exit", "/bye", "exit", "quit"):
        code, replies, err = chat_cli(
            capsys, monkeypatch, run_dir, ["Hello", quit_line, "Hi"], *GREEDY
        )
        assert code == 0 and replies == [first] and "error" not in err, (quit_line, err)
    lines = ["/rest", "/temp 0.3", "/sys Be brief.", "/top 5", "/sett"]
    code, _, err = chat_cli(capsys, monkeypatch, run_dir, lines, *GREEDY)
    assert "unknown command /rest. Did you mean /reset?" in err
    # A unique prefix is the command it begins, as a shell completes it.
    assert "temperature = 0.3\nsystem message set\n" in err
    assert "unknown command /top. Did you mean /top_k or /top_p?" in err
    assert " temperature=0.3 " in err and "top_k=" in err


def test_a_reply_is_one_line_on_a_pipe(run_dir, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n"))
    with pytest.raises(SystemExit):
        main(["chat", "--checkpoint", str(run_dir), *GREEDY])
    out = capsys.readouterr().out
    [line] = out.splitlines()
    assert "\\n" in line and unescape(line).count("\n") == 1  # the newline, escaped


@pytest.mark.parametrize(
    "text", ["", "a\nb", "back\\slash\\n", "\\\\n\t\r", "trailing\\", "two\n\nlines\n"]
)
def test_escape_is_undone_by_unescape(text) -> None:
    assert "\n" not in escape(text) and unescape(escape(text)) == text


def test_seed_is_respected_and_a_message_starting_with_a_slash(
    run_dir, capsys, monkeypatch
) -> None:
    sampled = ("--temperature", "1.0", "--top-k", "1000", "--max-new-tokens", "12")
    runs = [
        chat_cli(capsys, monkeypatch, run_dir, ["Hello", "Hello"], *sampled, "--seed", seed)[1]
        for seed in ("5", "5", "6")
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    # `//reset` is the message "/reset", not the command: the history stays ("/" is outside
    # this vocabulary, so the message itself is refused).
    code, replies, err = chat_cli(capsys, monkeypatch, run_dir, ["Hi", "//reset", "Hi"], *GREEDY)
    run = load_run(run_dir)
    first = greedy_reply(run, [user("Hi")], 20)[0]
    assert replies == [first, greedy_reply(run, [user("Hi"), assistant(first), user("Hi")], 20)[0]]
    assert code == 0 and "vocabulary lacks: '/'" in err


def test_sample_on_a_chat_run_names_the_character_its_vocabulary_lacks(capsys, run_dir) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["sample", "--checkpoint", str(run_dir), "--prompt", "café", "--no-stream"])
    err = " ".join(capsys.readouterr().err.split())
    assert exit_.value.code == 2
    assert "the text holds 1 character(s) that the tokenizer's vocabulary lacks: 'é'." in err
    assert "damaged" not in err


# The turns of CONVERSATIONS[1] and a last user turn, counted by hand with the char tokenizer
# (one token per character, one per chat token): a turn is its role token, "\n", its text,
# <|end|>, "\n"; the prompt ends with <|assistant|> "\n".
SYSTEM = {"role": "system", "content": "Be brief."}  # 1 + 1 + 9 + 1 + 1 = 13
TURNS = CONVERSATIONS[1]  # "Spell cat." 14, "c-a-t" 9; "And dog?" 12, "d-o-g" 9
# "Why?": 8, and the reply's start 2: the last user turn costs 10.


@pytest.mark.parametrize(
    "head, room, dropped, length",
    [
        ([SYSTEM], 20, 1, 13 + 21 + 10),  # 67 + 20 > 64; 44 + 20 fits
        ([SYSTEM], 21, 2, 13 + 10),  # 44 + 21 > 64
        ([SYSTEM], 60, 2, 13 + 10),  # nothing more to leave out: the last turn stays
        ([], 10, 0, 23 + 21 + 10),  # 54 + 10 fits
        ([], 11, 1, 21 + 10),
    ],
)
def test_history_is_cut_at_turn_boundaries(head, room, dropped, length) -> None:
    encoder = ConversationEncoder(default_template(), chat_tokenizer())
    messages, ids, n = fit_history(encoder, head, TURNS, "Why?", room, context_length=64)
    assert (n, len(ids)) == (dropped, length)
    assert messages == [*head, *TURNS[2 * dropped :], user("Why?")]
    assert ids == encoder.prompt(messages)


def test_the_command_line_cuts_the_history_and_says_so(run, run_dir, capsys, monkeypatch) -> None:
    # 30 new tokens: the prompt must leave 30 of the 64 free.
    script = ["Hello", "Spell cat.", "And dog?", "Hi"]
    code, replies, err = chat_cli(
        capsys, monkeypatch, run_dir, script, "--temperature", "0", "--max-new-tokens", "30"
    )
    assert code == 0, err
    encoder = ConversationEncoder(default_template(), run.tokenizer)
    turns: list[dict[str, str]] = []
    expected, cut = [], 0
    for text in script:
        kept = turns
        while kept and len(encoder.prompt([*kept, user(text)])) + 30 > 64:
            kept = kept[2:]
        cut += kept != turns
        reply, _ = greedy_reply(run, [*kept, user(text)], 30)
        expected.append(reply)
        turns = [*turns, user(text), assistant(reply)]
    assert replies == expected
    # One notice, the first time, however many turns are cut after it.
    assert cut >= 2 and err.count("no longer fits the context (64 tokens)") == 1, err


def test_session_commands_and_prompts(run) -> None:
    config = replace(run.config.sample, temperature=0.0, max_new_tokens=5)
    session = new_session(run, config, SampleOptions())
    encoder = ConversationEncoder(default_template(), run.tokenizer)
    assert session.prompt("Hi")[0] == encoder.prompt([user("Hi")])
    reply = session.reply("Hi").completion
    assert session.prompt("Yo")[0] == encoder.prompt([user("Hi"), assistant(reply), user("Yo")])
    assert session_command(session, "/system Be brief.") == ("system message set", False)
    assert session.prompt("Yo")[0] == encoder.prompt(
        [SYSTEM, user("Hi"), assistant(reply), user("Yo")]
    )
    session_command(session, "/reset")
    assert session.turns == [] and session.prompt("Yo")[0] == encoder.prompt([SYSTEM, user("Yo")])
    session_command(session, "/temperature 0.5")
    assert session.config.temperature == 0.5
    assert session_command(session, "/quit") == (None, True)
    with pytest.raises(InputError, match="temperature"):
        session_command(session, "/temperature -1")
    with pytest.raises(InputError, match=re.escape("'<|end|>'")):
        session_command(session, "/system a <|end|> b")


def test_ctrl_c_stops_a_reply_and_leaves_it_out(run) -> None:
    config = replace(run.config.sample, temperature=0.0, max_new_tokens=20)
    session = new_session(run, config, SampleOptions())
    written, notices = [], []

    def write(text: str) -> None:
        written.append(text)
        if len(written) == 2:
            raise KeyboardInterrupt

    assert respond(session, "Hello", write, notices.append) is None
    assert session.turns == [] and "stopped" in notices[0]
    assert written[-1] == "\n"  # the line is ended


def test_bad_lines_get_their_reason_and_the_session_goes_on(run, run_dir, capsys, monkeypatch):
    # Not UTF-8; a chat token in the text; a good line; characters outside the vocabulary.
    data = b"caf\xe9\nsay <|end|> now\nHello\n" + "\u00e9t\u00e9\n".encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    with pytest.raises(SystemExit) as exc:
        main(["chat", "--checkpoint", str(run_dir), *GREEDY])
    out = capsys.readouterr()
    assert exc.value.code == 0
    assert [unescape(line) for line in out.out.splitlines()] == [
        greedy_reply(run, [user("Hello")], 20)[0]
    ]
    errors = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 3 and "not UTF-8" in errors[0] and "'<|end|>'" in errors[1]


def test_a_run_without_a_template_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch):
    model = {"n_layer": 1, "n_head": 1, "n_embed": 8, "context_length": 16}
    plain = save_tiny_run(tmp_path / "plain", CharTokenizer("abc \n"), {"model": model})
    before = sorted((p.name, p.stat().st_mtime_ns) for p in plain.iterdir())
    with pytest.raises(InputError) as expected:
        require_run_template(plain)
    code, replies, err = chat_cli(capsys, monkeypatch, plain, ["abc"])
    assert code == 2 and replies == []
    assert err == f"error: {expected.value}\n" and "train.init_from" in err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in plain.iterdir()) == before


def test_bad_options_exit_2(run_dir, capsys, monkeypatch) -> None:
    code, _, err = chat_cli(capsys, monkeypatch, run_dir, [], "--system", "x<|user|>")
    assert code == 2 and "'<|user|>'" in err
    code, _, err = chat_cli(capsys, monkeypatch, run_dir, [], "--temperature", "-1")
    assert code == 2 and "temperature" in err


def test_steer_adds_the_feature_direction_to_a_reply(run, run_dir, tmp_path, capsys, monkeypatch):
    """`chat --steer` answers as the hand loop does with the direction added at the hook."""
    from llmcli.inspection.sae.folder import SAEInfo, save_sae
    from llmcli.inspection.sae.model import SparseAutoencoder

    hook, width = "blocks.1.resid_post", run.config.model.n_embed
    sae = SparseAutoencoder(width, 16, 4, generator=torch.Generator().manual_seed(3))
    save_sae(tmp_path / "sae", sae, SAEInfo(hook=hook, run=str(run_dir), settings={}), 64)
    code, steered, err = chat_cli(
        capsys, monkeypatch, run_dir, ["Hi"], *GREEDY, "--steer", f"{tmp_path / 'sae'}:3=40"
    )
    assert code == 0, err
    direction = sae.W_dec[3].detach()
    with run.model.hooks({hook: lambda h: h + 40 * direction}):
        by_hand = greedy_reply(run, [user("Hi")], 20)[0]
    assert steered == [by_hand] and by_hand != greedy_reply(run, [user("Hi")], 20)[0]


@pytest.mark.slow
def test_ctrl_c_from_a_terminal_never_ends_the_chat(tmp_path) -> None:
    # A long context: the greedy reply to "Spell cat." runs on past Ctrl-C.
    long = save_chat_run(tmp_path / "chat", seed=MODEL_SEED, sharpen=8.0, context_length=4096)
    args = ["llmcli", "chat", "--checkpoint", str(long), "--temperature", "0"]
    ctrl_c_leaves_the_session_on(
        [*args, "--max-new-tokens", "2000"], "you> ", b"Spell cat.", "stopped (Ctrl-C)"
    )


def test_chat_names_its_latest_run_and_no_text_run_it_would_refuse(
    run_dir, tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copytree(run_dir, tmp_path / "checkpoints" / "chat")
    model = {"n_layer": 1, "n_head": 1, "n_embed": 8, "context_length": 16}
    text = save_tiny_run(
        tmp_path / "checkpoints" / "tiny2", CharTokenizer("abc \n"), {"model": model}
    )
    os.utime(
        tmp_path / "checkpoints" / "chat" / "model.safetensors", (1, 1)
    )  # the text run is newer
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n"))
    with pytest.raises(SystemExit) as exc:
        main(["chat", *GREEDY])
    err = capsys.readouterr().err
    assert exc.value.code == 0, err
    assert f"using the latest chat run: {Path('checkpoints') / 'chat'}, at step 0\n" in err
    assert str(text.name) not in err
