"""Preference pairs: rows checked as TRL's shape, and ids split into prompt and completions as
TRL's DPOTrainer splits them."""

import json

import numpy as np
import pytest
from chat_helpers import CHARS, chat_tokenizer

from llmcli.data.chat_template import default_template
from llmcli.data.conversations import ConversationEncoder
from llmcli.data.preferences import (
    Preference,
    PreferenceEncoder,
    check_preference,
    read_preferences,
)
from llmcli.data.tokenizer import BPETokenizer, CharTokenizer
from llmcli.errors import InputError

# The chat tokenizer's ids, by hand: each character its rank, then <|endoftext|>, then the chat
# tokens in the order add_chat_tokens adds them.
RANK = {c: i for i, c in enumerate(sorted(set(CHARS)))}
EOT, USER, ASSISTANT, END = 62, 64, 65, 66


def hand(*pieces: str | int) -> list[int]:
    """Ids of text pieces (one id a character) and token ids, in order."""
    return [i for p in pieces for i in ([p] if isinstance(p, int) else [RANK[c] for c in p])]


def _row(prompt, chosen, rejected) -> dict:
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


PROMPT = [{"role": "user", "content": "Hello"}]
CHOSEN = [{"role": "assistant", "content": "Hi!"}]
REJECTED = [{"role": "assistant", "content": "Go away."}]


def test_a_conversational_pair_is_the_prompt_then_each_assistant_turn():
    encoder = PreferenceEncoder(chat_tokenizer(), default_template())
    pair = encoder.encode(check_preference(_row(PROMPT, CHOSEN, REJECTED), "p.jsonl line 1"))

    assert pair.prompt.tolist() == hand(USER, "\nHello", END, "\n", ASSISTANT, "\n")
    # The assistant turn as the template writes it: text, end of turn, and the newline after.
    assert pair.chosen.tolist() == hand("Hi!", END, "\n")
    assert pair.rejected.tolist() == hand("Go away.", END, "\n")
    assert pair.prompt.dtype == pair.chosen.dtype == np.int64

    # The same ids as the conversation encoder's, which training on chat data uses.
    conversations = ConversationEncoder(default_template(), chat_tokenizer())
    whole = conversations.encode([*PROMPT, *CHOSEN])
    assert np.concatenate([pair.prompt, pair.chosen]).tolist() == whole.ids.tolist()
    assert pair.prompt.tolist() == conversations.prompt(PROMPT)
    # The completion is what the model writes, and the template's newline after it.
    assert whole.mask[len(pair.prompt) :].tolist() == [True] * 4 + [False]


def test_a_system_message_and_earlier_turns_stay_in_the_prompt():
    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yes?"},
        {"role": "user", "content": "Bye"},
    ]
    encoder = PreferenceEncoder(chat_tokenizer(), default_template())
    pair = encoder.encode(check_preference(_row(prompt, CHOSEN, REJECTED), "p.jsonl line 1"))
    assert pair.prompt.tolist() == hand(
        63, "\nBe brief.", END, "\n", USER, "\nHi", END, "\n", ASSISTANT, "\nYes?", END, "\n",
        USER, "\nBye", END, "\n", ASSISTANT, "\n",
    )  # fmt: skip
    assert pair.chosen.tolist() == hand("Hi!", END, "\n")


def test_a_text_pair_ends_each_completion_with_the_end_of_text_token_once():
    encoder = PreferenceEncoder(chat_tokenizer(), None)
    row = _row("Spell cat: ", "c-a-t", "dog<|endoftext|>")
    pair = encoder.encode(check_preference(row, "p.jsonl line 1"))
    assert pair.prompt.tolist() == hand("Spell cat: ")
    assert pair.chosen.tolist() == hand("c-a-t", EOT)
    assert pair.rejected.tolist() == hand("dog", EOT)  # it ended with it already: not twice


def test_a_completion_starts_where_the_prompt_stops_agreeing_with_both_sequences():
    # BPE merges " c" + "at" across the join, so the prompt's last token is not the sequence's:
    # the completions start where the prompt stops agreeing with either (TRL's
    # common_prefix_length), and the prompt loses its end.
    tokenizer = BPETokenizer.train(["the cat sat on the mat. the cat ate."] * 20, 300)
    encoder = PreferenceEncoder(tokenizer, None)
    pair = encoder.encode(check_preference(_row("the c", "at", "ow"), "p.jsonl line 1"))
    assert tokenizer.encode("the c") == tokenizer.encode("the") + tokenizer.encode(" c")
    assert tokenizer.encode("the cat") == tokenizer.encode("the") + tokenizer.encode(" cat")
    eot = [tokenizer.eot_id]
    # "the" is all that the prompt shares with "the cat": both completions start after it, so
    # the rejected one carries the prompt's " c" again.
    assert pair.prompt.tolist() == tokenizer.encode("the")
    assert pair.chosen.tolist() == tokenizer.encode(" cat") + eot
    assert pair.rejected.tolist() == tokenizer.encode(" cow") + eot


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "a", "chosen": "b"}, r"must have \"prompt\", .* \(it has no 'rejected'\)"),
        ({"chosen": "b", "rejected": "c"}, r"\(it has no 'prompt'\)"),
        (_row("a", "same", "same"), "'chosen' and 'rejected' are the same reply"),
        (_row(PROMPT, CHOSEN, list(CHOSEN)), "'chosen' and 'rejected' are the same reply"),
        (_row(3, "b", "c"), "'prompt' must be text or a list of .* \\(got int\\)"),
        (_row({"role": "user"}, "b", "c"), "'prompt' must be text .* \\(got dict\\)"),
        (_row([], CHOSEN, REJECTED), "'prompt' must be a non-empty list"),
        (_row("a", CHOSEN, "c"), "the prompt is text, so 'chosen' must be text too"),
        (_row(PROMPT, "b", REJECTED), "so 'chosen' must be a list of one assistant message"),
        (_row(PROMPT, CHOSEN, CHOSEN + REJECTED), "'rejected' must be a list of one assistant"),
        (_row(PROMPT, CHOSEN, PROMPT), "'rejected' must be a list of one assistant"),
        (_row(PROMPT + CHOSEN, CHOSEN, REJECTED), "the last message must be the user's"),
        (
            _row(PROMPT, [{"role": "assistant", "content": "x<|end|>"}], REJECTED),
            r"\(prompt \+ chosen\): message 1 \(assistant\) holds '<\|end\|>'",
        ),
    ],
)
def test_bad_rows_are_refused_naming_the_row_and_the_fix(row, message):
    with pytest.raises(InputError, match=message) as err:
        check_preference(row, "prefs.jsonl line 4")
    assert str(err.value).startswith("prefs.jsonl line 4")


def test_rows_the_run_cannot_encode_are_refused_naming_the_row():
    conversational = check_preference(_row(PROMPT, CHOSEN, REJECTED), "p.jsonl line 2")
    with pytest.raises(InputError, match="p.jsonl line 2: the row is messages, and the run has no"):
        PreferenceEncoder(chat_tokenizer(), None).encode(conversational)
    text = check_preference(_row("ab", "c", "d"), "p.jsonl line 3")
    with pytest.raises(InputError, match="p.jsonl line 3: a text completion ends with the end-of"):
        PreferenceEncoder(CharTokenizer("abcd", eot=None), None).encode(text)
    unknown = check_preference(_row("ab", "c", "d~"), "p.jsonl line 5")
    with pytest.raises(InputError, match="p.jsonl line 5: .*lacks: '~'"):
        PreferenceEncoder(chat_tokenizer(), None).encode(unknown)


def test_a_file_of_rows_is_read_naming_each_line(tmp_path):
    path = tmp_path / "prefs.jsonl"
    rows = [_row("Hi ", "there", "you"), _row(PROMPT, CHOSEN, REJECTED)]
    path.write_text("\n".join(json.dumps(r) for r in [rows[0], {}, rows[1]]).replace("{}", ""))
    read = list(read_preferences(path))
    assert read == [
        Preference("Hi ", "there", "you", f"{path} line 1"),
        Preference(PROMPT, CHOSEN, REJECTED, f"{path} line 3"),
    ]
    assert [p.conversational for p in read] == [False, True]

    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"prompt": "a", "chosen": "b"}))
    with pytest.raises(InputError, match=rf"{path} line 2: a row must be an object with "):
        list(read_preferences(path))
    path.write_text(json.dumps(_row("a", "b", "b")))
    with pytest.raises(InputError, match=rf"{path} line 1: 'chosen' and 'rejected' are the same"):
        list(read_preferences(path))
