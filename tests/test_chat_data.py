"""Conversation data (llmcli/data/chat.py) and its batches (llmcli/data/chat_batches.py):
the loss mask against a hand computation, windows cut at turn ends or skipped, the cache, the
validation split, a `datasets` source, exact resume of the sampler, and bad rows; packed rows
(best fit by hand, whole conversations, their share of real tokens, exact resume, packing off).

The tokenizer is a char tokenizer with the chat tokens added (tests/chat_helpers.py), so a
conversation's ids can be written down by hand: one per character, one per chat token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_helpers import CHARS, CONVERSATIONS, chat_tokenizer

from llmcli.config import Config, DataConfig, config_from_dict
from llmcli.data.chat import conversation_windows, prepare_chat_data
from llmcli.data.chat_batches import ChatSampler, PackedChatSampler, best_fit
from llmcli.data.prepared import ChatSplit
from llmcli.errors import InputError
from llmcli.objectives import Objective, objective_for
from llmcli.training.distributed import DistInfo
from llmcli.training.evaluate import split_sampler

CHAR_IDS = {c: i for i, c in enumerate(sorted(set(CHARS)))}  # a char tokenizer's ids
SYSTEM, USER, ASSISTANT, END = range(len(CHAR_IDS) + 1, len(CHAR_IDS) + 5)  # after <|endoftext|>


def ids_of(*parts: str | int) -> list[int]:
    """Hand-made ids: each string one id per character, each int as it is (a chat token)."""
    out: list[int] = []
    for part in parts:
        out.extend([part] if isinstance(part, int) else [CHAR_IDS[c] for c in part])
    return out


def write_jsonl(path: Path, conversations: list) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer.json"
    chat_tokenizer().save(path)
    return path


def chat_config(tmp_path: Path, tokenizer_file: Path, train: list, val: list, **data) -> DataConfig:
    config = DataConfig(
        path=str(write_jsonl(tmp_path / "train.jsonl", train)),
        val_path=str(write_jsonl(tmp_path / "val.jsonl", val)),
        tokenizer=str(tokenizer_file),
        cache_dir=str(tmp_path / "cache"),
        format="chat",
        **data,
    )
    config.validate()
    return config


HELLO = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]


def test_the_targets_are_the_assistants_tokens_and_its_end_of_turn(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    data = prepare_chat_data(chat_config(tmp_path, tokenizer_file, [HELLO], [HELLO]), 16)
    # <|user|>\nHi<|end|>\n<|assistant|>\nYo<|end|>\n, by hand: 12 ids.
    ids = ids_of(USER, "\nHi", END, "\n", ASSISTANT, "\nYo", END, "\n")
    assert np.array_equal(np.asarray(data.train), ids)
    x, y = ChatSampler(data.chat.train, data.chat.pad_id, 3, 16, seed=0).next()
    # x: the first 11 ids, then the end-of-turn token as padding; y: -1 but where the next
    # token is one the assistant writes: "Y" (after "\n", position 7), "o" (8) and <|end|> (9).
    expected_x = ids[:11] + [END] * 5
    expected_y = [-1] * 7 + ids_of("Yo", END) + [-1] * 6
    assert x.tolist() == [expected_x] * 3
    assert y.tolist() == [expected_y] * 3
    # The model's loss on (x, y) counts exactly those three targets.
    logits = torch.randn(3, 16, data.tokenizer.vocab_size)
    kept = torch.nn.functional.cross_entropy(logits[:, 7:10].flatten(0, 1), y[:, 7:10].flatten())
    masked = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1)
    torch.testing.assert_close(masked, kept)


def test_a_long_conversation_is_cut_after_the_last_assistant_turn_that_fits(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    # By hand, with one id per character and per chat token ("S", "U", "A", "E"):
    system_first = "S\nBe brief.E\nU\nHelloE\nA\nHi!E\n"  # 29 ids, its turn ends after 28
    spell = "U\nSpell cat.E\nA\nc-a-tE"  # the first 22 ids of the second, to its first turn end
    assert (len(system_first), len(spell)) == (29, 22)
    config = chat_config(tmp_path, tokenizer_file, CONVERSATIONS, CONVERSATIONS)
    cases = {  # context_length: (kept, truncated, skipped), window lengths, rows left out
        43: ((2, 0, 0), [29, 44], []),
        30: ((1, 1, 0), [29, 22], []),
        25: ((0, 1, 1), [22], [0]),
    }
    for context_length, (counts, lengths, left_out) in cases.items():
        data = prepare_chat_data(config, context_length)
        for split in (data.chat.train, data.chat.val):
            got = split.counts
            assert (got["kept"], got["truncated"], got["skipped"]) == counts, context_length
            assert got["conversations"] == 2
            assert split.lengths.tolist() == lengths
            assert split.skipped_rows == left_out  # the rows the warning names
    # Context 30: the second conversation's window ends with the first reply's <|end|>.
    data = prepare_chat_data(config, 30)
    sampler = ChatSampler(data.chat.train, data.chat.pad_id, 8, 30, seed=1)
    x, y = sampler.next()
    rows = [r for r in range(8) if x[r, 0] == USER]
    assert rows, "the second conversation was drawn"
    expected_y = [-1] * 15 + ids_of("c-a-t", END) + [-1] * 9  # "c" follows position 15
    assert y[rows[0]].tolist() == expected_y
    with pytest.raises(
        InputError,
        match=r"nothing left to learn from: 2 conversations of the train split .* \(21 tokens\)",
    ):
        prepare_chat_data(config, 20)


def test_windows_of_hand_made_masks() -> None:
    # Three conversations of 6, 5 and 4 tokens; 1 marks what the model writes.
    mask = np.array([0, 1, 1, 0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 1, 1], dtype=np.uint8)
    offsets = np.array([0, 6, 11, 15])
    # Context 4 (5 tokens a window): the first ends its turns after 3 and 6 tokens: cut at 3;
    # the second (5) is whole; the third (4) is whole.
    starts, lengths, counts = conversation_windows(mask, offsets, 4)
    assert starts.tolist() == [0, 6, 11] and lengths.tolist() == [3, 5, 4]
    assert counts == {"conversations": 3, "kept": 2, "truncated": 1, "skipped": 0}
    # Context 2 (3 tokens): the first cut at 3, the second's turn ends after 3 (index 8): cut,
    # the third has no turn end within 3 tokens: skipped.
    starts, lengths, counts = conversation_windows(mask, offsets, 2)
    assert starts.tolist() == [0, 6] and lengths.tolist() == [3, 3]
    assert counts == {"conversations": 3, "kept": 0, "truncated": 2, "skipped": 1}


def test_a_window_with_nothing_to_learn_after_its_first_token_is_skipped() -> None:
    # Three conversations: one to learn from; one whose only written token is its first (a
    # custom template's), which nothing predicts; one with no written token at all.
    mask = np.array([0, 1, 1, 1, 0, 0, 0, 0, 0, 0], dtype=np.uint8)
    offsets = np.array([0, 3, 6, 10])
    starts, lengths, counts = conversation_windows(mask, offsets, 8)
    assert starts.tolist() == [0] and lengths.tolist() == [3]
    assert counts == {"conversations": 3, "kept": 1, "truncated": 0, "skipped": 2}


def test_the_cache_is_reused_and_keyed_by_the_template(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    config = chat_config(tmp_path, tokenizer_file, CONVERSATIONS, [HELLO])
    first = prepare_chat_data(config, 64)
    mtimes = [f.stat().st_mtime_ns for f in first.cache_files]
    second = prepare_chat_data(config, 32)  # another context: the same cache files
    assert second.cache_files == first.cache_files
    assert [f.stat().st_mtime_ns for f in second.cache_files] == mtimes
    assert np.array_equal(second.train, first.train) and second.source_hash == first.source_hash
    # Another template is another key: the same text, different ids for "<|assistant|>".
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|end|>' }}"
        "{% endgeneration %}{% else %}{{ m['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    )
    config.chat_template = str(template)
    other = prepare_chat_data(config, 64)
    assert set(other.cache_files).isdisjoint(first.cache_files)
    assert other.source_hash != first.source_hash
    assert np.asarray(other.val).tolist() == ids_of(USER, "Hi", END, ASSISTANT, "Yo", END)


def test_the_last_val_fraction_of_the_conversations_is_held_out(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    rows = [
        [{"role": "user", "content": f"n {c}"}, {"role": "assistant", "content": c * (i + 1)}]
        for i, c in enumerate("abcdefghij")
    ]
    config = chat_config(tmp_path, tokenizer_file, rows, [HELLO], val_fraction=0.2)
    config.val_path = None
    data = prepare_chat_data(config, 64)
    one = [
        len(ids_of(USER, "\nn a", END, "\n", ASSISTANT, "\n", END, "\n")) + i + 1 for i in range(10)
    ]
    assert data.chat.train.counts["conversations"] == 8
    assert data.chat.val.counts["conversations"] == 2
    assert len(data.train) == sum(one[:8]) and len(data.val) == sum(one[8:])
    assert data.chat.val.starts.tolist() == [0, one[8]]
    assert np.asarray(data.val[: one[8]]).tolist() == ids_of(
        USER, "\nn i", END, "\n", ASSISTANT, "\n" + "i" * 9, END, "\n"
    )
    config.path = str(write_jsonl(tmp_path / "one.jsonl", rows[:1]))
    with pytest.raises(InputError, match="1 conversation: too few to hold out"):
        prepare_chat_data(config, 64)


def test_a_datasets_source_gives_the_files_conversations(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    files = chat_config(tmp_path, tokenizer_file, CONVERSATIONS, [HELLO])
    from_files = prepare_chat_data(files, 64)
    dataset = DataConfig(
        dataset=str(tmp_path / "train.jsonl"),
        path=None,
        val_path=str(tmp_path / "val.jsonl"),
        tokenizer=str(tokenizer_file),
        cache_dir=str(tmp_path / "cache"),
        format="chat",
    )
    from_dataset = prepare_chat_data(dataset, 64)
    assert np.array_equal(from_dataset.train, from_files.train)
    assert np.array_equal(from_dataset.chat.train.mask, from_files.chat.train.mask)
    assert np.array_equal(from_dataset.val, from_files.val)


def test_the_sampler_resumes_exactly_and_each_rank_draws_its_own(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    rows = [
        [{"role": "user", "content": c}, {"role": "assistant", "content": c * 3}]
        for c in CHARS[20:40]
    ]
    data = prepare_chat_data(chat_config(tmp_path, tokenizer_file, rows, [HELLO]), 32)

    def sampler(rank: int = 0) -> ChatSampler:
        return ChatSampler(data.chat.train, data.chat.pad_id, 4, 32, 5, rank=rank, world_size=2)

    straight = sampler()
    batches = [straight.next() for _ in range(5)]
    first = sampler()
    for _ in range(3):
        first.next()
    state = first.state_dict()
    resumed = sampler()
    resumed.load_state_dict(state)
    assert resumed.batches == 3
    for x, y in batches[3:]:
        rx, ry = resumed.next()
        assert torch.equal(rx, x) and torch.equal(ry, y)
    other = sampler(rank=1).next()
    assert not torch.equal(other[0], batches[0][0])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"messages": [', r"bad\.jsonl line 2 is not JSON"),
        ('{"text": "hi"}', r"bad\.jsonl line 2: a row must be an object with \"messages\""),
        (
            '{"messages": [{"role": "robot", "content": "hi"}]}',
            r"bad\.jsonl line 2: message 0 has the unknown role 'robot'",
        ),
        (
            '{"messages": [{"role": "user", "content": "hi"}]}',
            r"bad\.jsonl line 2: the conversation has no assistant turn",
        ),
        (
            '{"messages": [{"role": "assistant", "content": "hi"}, '
            '{"role": "user", "content": "a"}]}',
            r"bad\.jsonl line 2: the roles \['assistant', 'user'\] are out of order",
        ),
    ],
)
def test_a_bad_row_is_named_by_file_and_line(
    tmp_path: Path, tokenizer_file: Path, line: str, message: str
) -> None:
    config = chat_config(tmp_path, tokenizer_file, [HELLO], [HELLO])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": HELLO}) + "\n" + line + "\n")
    config.path = str(bad)
    with pytest.raises(InputError, match=message):
        prepare_chat_data(config, 32)


def test_templates_that_do_not_parse_or_render_and_tokenizers_without_chat_tokens(
    tmp_path: Path, tokenizer_file: Path
) -> None:
    config = chat_config(tmp_path, tokenizer_file, [HELLO], [HELLO])
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    config.chat_template = str(broken)
    with pytest.raises(InputError, match=r"broken\.jinja\) is not a valid Jinja template"):
        prepare_chat_data(config, 32)
    refusing = tmp_path / "refusing.jinja"
    refusing.write_text("{{ raise_exception('no system messages') }}")
    config.chat_template = str(refusing)
    with pytest.raises(InputError, match=r"train\.jsonl line 1: .* does not render .*no system"):
        prepare_chat_data(config, 32)
    # Without {% generation %}, the prefix rule marks what the assistant's turn adds.
    unmarked = tmp_path / "unmarked.jinja"
    unmarked.write_text("{% for m in messages %}{{ m['content'] + '<|end|>' }}{% endfor %}")
    config.chat_template = str(unmarked)
    data = prepare_chat_data(config, 32)
    assert np.asarray(data.train).tolist() == ids_of("Hi", END, "Yo", END)
    assert np.asarray(data.chat.train.mask).tolist() == [0, 0, 0, 1, 1, 1]
    empty = tmp_path / "empty.jinja"  # a {% generation %} around nothing marks nothing
    empty.write_text(unmarked.read_text() + "{% generation %}{% endgeneration %}")
    config.chat_template = str(empty)
    with pytest.raises(InputError, match=r"empty\.jinja\) marks none of the train split"):
        prepare_chat_data(config, 32)
    config.chat_template = None
    from llmcli.data.tokenizer import CharTokenizer

    with pytest.raises(InputError, match="the run's tokenizer has no chat tokens"):
        prepare_chat_data(config, 32, tokenizer=CharTokenizer(CHARS))


def test_best_fit_decreasing_by_hand() -> None:
    # Longest first, each into the tightest row that holds it: 6 -> row 0 (2 left), 5 -> row 1
    # (3 left), 4 fits neither, 3 -> row 1 (0 left), 2 -> row 0 (0 left).
    placed, left = best_fit([5, 3, 4, 2, 6], rows=2, room=8)
    assert placed == [[4, 3], [0, 1]] and left == [2]
    assert best_fit([3, 3], rows=3, room=8) == ([[0, 1], [], []], [])  # ties: the first row


def synthetic_split(n: int = 300, seed: int = 0) -> ChatSplit:
    """`n` conversations of 23..50 tokens (22..49 positions, about the chat example's), ids
    0, 1, 2, ... one after another (so each token names its place), the second half of each
    the assistant's."""
    lengths = np.random.default_rng(seed).integers(23, 51, n)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    mask = np.concatenate([np.arange(k) >= k // 2 for k in lengths]).astype(np.uint8)
    tokens = np.arange(int(lengths.sum()), dtype=np.uint16)
    return ChatSplit(tokens, mask, starts, lengths, {"conversations": n})


def test_packing_fills_the_rows_with_whole_conversations() -> None:
    split, B, T, pad = synthetic_split(), 8, 64, 60000
    sampler = PackedChatSampler(split, pad, B, T, seed=3)
    first = {int(s): k for k, s in enumerate(split.starts)}
    shares, read = [], 0
    for _ in range(30):
        x, y, segments = sampler.next()
        read += int((segments != 0).sum())
        assert sampler.tokens_drawn == read  # the log's tokens: the padding left out
        placed = 0
        for row in range(B):
            seg = segments[row].tolist()
            n = sum(s != 0 for s in seg)
            assert seg == sorted(seg[:n]) + [0] * (T - n)  # conversations first, then padding
            assert x[row, n:].eq(pad).all() and y[row, n:].eq(-1).all()
            for s in range(1, max(seg) + 1):
                at = seg.index(s)
                k = first[int(x[row, at])]  # whose first token starts the segment
                length = int(split.lengths[k])
                assert seg.count(s) == length - 1  # whole: all its L - 1 positions
                ids = torch.arange(int(split.starts[k]), int(split.starts[k]) + length)
                assert x[row, at : at + length - 1].tolist() == ids[:-1].tolist()
                written = torch.from_numpy(split.mask[ids[1:].numpy()].astype(bool))
                assert (
                    y[row, at : at + length - 1].tolist()
                    == torch.where(written, ids[1:], -1).tolist()
                )
                placed += 1
            shares.append(n / T)
        # What was not packed waits in the pool, topped up to twice the batch each time.
        assert placed + len(sampler.pool) == 2 * B
    assert np.mean(shares) >= 0.75, np.mean(shares)
    assert np.mean(split.lengths - 1) / T < 0.6  # one a row would fill less than 60%


def test_the_packed_sampler_resumes_exactly() -> None:
    split = synthetic_split(seed=1)
    straight = PackedChatSampler(split, 60000, 4, 64, seed=5)
    batches = [straight.next() for _ in range(6)]
    first = PackedChatSampler(split, 60000, 4, 64, seed=5)
    for _ in range(3):
        first.next()
    state = first.state_dict()
    assert len(state["pool"]) > 0  # conversations drawn, not yet packed, carried over
    resumed = PackedChatSampler(split, 60000, 4, 64, seed=5)
    resumed.load_state_dict(state)
    assert resumed.batches == 3
    for expected in batches[3:]:
        for got, want in zip(resumed.next(), expected, strict=True):
            assert torch.equal(got, want)
    other = PackedChatSampler(split, 60000, 4, 64, seed=5, rank=1, world_size=2).next()
    assert not torch.equal(other[0], batches[0][0])


def test_packing_off_gives_one_conversation_a_row(tmp_path: Path, tokenizer_file: Path) -> None:
    data_cfg = chat_config(tmp_path, tokenizer_file, CONVERSATIONS * 3, [HELLO])
    data = prepare_chat_data(data_cfg, 48)
    cpu, info = torch.device("cpu"), DistInfo()

    def config(**data_keys: object) -> Config:
        return config_from_dict({"model": {"context_length": 48}, "data": data_keys})

    for packing, kind in ((False, ChatSampler), (True, PackedChatSampler)):
        chat = config(format="chat", packing=packing)
        assert objective_for(chat).packs is packing
        sampler = split_sampler(data, "train", chat, 7, info, cpu, training=True)
        assert type(sampler) is kind
    assert objective_for(config(format="chat")).packs  # on by default
    text = objective_for(config(format="text", packing=True))  # the other formats ignore it
    assert type(text) is Objective and not hasattr(text, "packs")
    # Off: the batches of today's sampler, one conversation a row from its first token.
    chat = config(format="chat", packing=False)
    off = split_sampler(data, "train", chat, 7, info, cpu, training=True)
    today = ChatSampler(data.chat.train, data.chat.pad_id, chat.train.batch_size, 48, 7)
    for _ in range(2):
        (x, y), (tx, ty) = off.next(), today.next()
        assert torch.equal(x, tx) and torch.equal(y, ty)
    assert set(x[:, 0].tolist()) <= {SYSTEM, USER}  # each row starts a conversation
    # Evaluation's samplers stay one a row with packing on.
    assert type(split_sampler(data, "val", config(format="chat"), 7, info, cpu)) is ChatSampler
