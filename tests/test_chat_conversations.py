"""Conversations: the checks on messages, JSONL rows, and the ids and loss mask of a turn."""

from __future__ import annotations

import json

import numpy as np
import pytest
from chat_helpers import CHARS, CONVERSATIONS, chat_tokenizer

from llmcli.data.chat_template import CHAT_TOKENS, default_template
from llmcli.data.conversations import (
    ConversationEncoder,
    add_chat_tokens,
    check_messages,
    read_jsonl,
)
from llmcli.data.tokenizer import BPETokenizer, CharTokenizer, tokenizer_from_json
from llmcli.errors import InputError


def test_the_mask_marks_the_assistant_text_and_its_end_token_as_counted_by_hand():
    tok = chat_tokenizer()
    encoded = ConversationEncoder(default_template(), tok).encode(CONVERSATIONS[0])
    # By hand: <|system|> \n B e _ b r i e f . <|end|> \n   -> 13 tokens, none written
    #          <|user|> \n H e l l o <|end|> \n             -> 9 tokens, none written
    #          <|assistant|> \n                              -> 2 tokens, not written
    #          H i ! <|end|>                                 -> 4 tokens, written
    #          \n                                            -> 1 token, not written
    expected = [False] * (13 + 9 + 2) + [True] * 4 + [False]
    assert encoded.mask.tolist() == expected
    written = [
        tok.decode([i]) for i, m in zip(encoded.ids.tolist(), encoded.mask, strict=True) if m
    ]
    assert written == ["H", "i", "!", "<|end|>"]
    assert (
        tok.decode(encoded.ids.tolist())
        == default_template().render(CONVERSATIONS[0], add_generation_prompt=False).text
    )


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_ids_and_mask_equal_transformers_apply_chat_template(kind):
    from transformers import PreTrainedTokenizerFast

    base = (
        CharTokenizer(CHARS)
        if kind == "char"
        else BPETokenizer.train([CHARS * 3, "Hello, hello, spell cat and dog."], 300)
    )
    tok = add_chat_tokens(base)
    encoder = ConversationEncoder(default_template(), tok)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.hf, chat_template=default_template().source)
    for messages in CONVERSATIONS:
        ours = encoder.encode(messages)
        theirs = hf.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ours.ids.tolist() == theirs["input_ids"]
        assert ours.mask.astype(int).tolist() == theirs["assistant_masks"]
        prompt = hf.apply_chat_template(
            messages[:-1], tokenize=True, return_dict=True, add_generation_prompt=True
        )
        assert encoder.prompt(messages[:-1]) == prompt["input_ids"]


def test_chat_tokens_come_after_the_old_ids_which_keep_their_text():
    base = CharTokenizer(CHARS)
    tok = add_chat_tokens(base)
    assert tok.vocab_size == base.vocab_size + len(CHAT_TOKENS)
    assert [tok.hf.token_to_id(t) for t in CHAT_TOKENS] == list(
        range(base.vocab_size, tok.vocab_size)
    )
    assert tok.encode("Spell cat.\n") == base.encode("Spell cat.\n")
    assert tok.eot_id == base.eot_id
    assert add_chat_tokens(tok) is tok  # a tokenizer that has them is kept as it is
    again = tokenizer_from_json(tok.to_json())  # a run's tokenizer.json reads back the same
    assert again.encode("<|user|>\nHi<|end|>") == tok.encode("<|user|>\nHi<|end|>")


def test_an_encoder_needs_a_tokenizer_with_the_chat_tokens():
    with pytest.raises(InputError, match=r"no <\|system\|>, <\|user\|>"):
        ConversationEncoder(default_template(), CharTokenizer(CHARS))


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"role": "robot", "content": "hi"}], "unknown role 'robot'"),
        ([{"role": "user"}], "string 'content'"),
        ([{"role": "user", "content": "hi", "mood": "x"}], "'role' and 'content'"),
        ([{"role": "assistant", "content": "hi"}], "out of order"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "out of order"),
        (
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
            "out of order",
        ),
        ([{"role": "user", "content": "hi"}], "no assistant turn"),
        ([{"role": "user", "content": "say <|end|> now"}], "holds '<\\|end\\|>'"),
    ],
)
def test_bad_messages_are_refused_naming_where(messages, message):
    with pytest.raises(InputError, match=message) as err:
        check_messages(messages, "rows.jsonl line 7")
    assert str(err.value).startswith("rows.jsonl line 7")


def test_a_prompt_ends_with_the_users_turn():
    assert check_messages([{"role": "user", "content": "hi"}], "request", complete=False)
    with pytest.raises(InputError, match="last message must be the user's"):
        check_messages(CONVERSATIONS[0], "request", complete=False)


def test_jsonl_rows_are_read_and_a_bad_line_is_named_by_file_and_number(tmp_path):
    path = tmp_path / "talk.jsonl"
    good = json.dumps({"messages": CONVERSATIONS[0]})
    path.write_text(f"{good}\n\n{good}\n", encoding="utf-8")
    rows = list(read_jsonl(path))
    assert [where for _, where in rows] == [f"{path} line 1", f"{path} line 3"]
    assert rows[0][0] == CONVERSATIONS[0]

    path.write_text(f"{good}\n{{'messages': []}}\n", encoding="utf-8")
    with pytest.raises(InputError, match=rf"{path} line 2 is not JSON"):
        list(read_jsonl(path))
    path.write_text('{"text": "no messages"}\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"line 1: a row must be an object with \"messages\""):
        list(read_jsonl(path))
    path.write_text(good + "\n" + "[" * 100_000 + "]" * 100_000 + "\n", encoding="utf-8")
    with pytest.raises(InputError, match="line 2 is JSON nested too deeply"):
        list(read_jsonl(path))
    path.write_bytes(good.encode() + b"\n\xff\xfe\n")
    offset = len(good) + 1  # the bad byte's, in the file
    binary = (
        rf"line 2 is not UTF-8 text \(byte 0xff at offset {offset} of the file\): is it a binary"
    )
    with pytest.raises(InputError, match=binary):
        list(read_jsonl(path))


def test_the_mask_is_the_same_array_whatever_the_turn_count():
    encoder = ConversationEncoder(default_template(), chat_tokenizer())
    encoded = encoder.encode(CONVERSATIONS[1])
    tok = encoder.tokenizer
    runs = np.flatnonzero(np.diff(np.r_[0, encoded.mask.astype(int), 0]))  # run starts/ends
    pieces = [tok.decode(encoded.ids[a:b].tolist()) for a, b in runs.reshape(-1, 2)]
    assert pieces == ["c-a-t<|end|>", "d-o-g<|end|>"]
