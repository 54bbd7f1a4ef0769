"""Conversation data (`data.format: chat`): JSONL conversations to masked windows of the cache.

Rows hold `{"messages": [{"role", "content"}, ...]}` (`llmcli.data.conversations`), read from
`data.path` (a `.jsonl` file, a folder of `.jsonl` files or a glob) or from `data.dataset` (a
`datasets` source with a `messages` column). Each conversation is rendered with the chat
template (`data.chat_template`, default the built-in one) and encoded with its loss mask: True
on the tokens the model is trained to write, the assistant's text and its end-of-turn token.

The ids, the mask and the conversations' offsets go into the token cache
(`llmcli.data.token_cache`), as `tokens/<key>.bin` (the ids, uint16/uint32), `<key>.mask.bin` (one
uint8 per token) and `<key>.offsets.bin` (int64, conversation i is `offsets[i]:offsets[i+1]`),
with `<key>.json` written last: the record that the three are whole. The key hashes the
conversations, the template and the tokenizer, not the context length, so one cache serves
every model size.

A window is one conversation from its first token, `context_length + 1` tokens at most (the
sampler pads the rest, `llmcli.data.chat_batches.ChatSampler`). A longer conversation is cut after
the last assistant turn that ends within the window (truncated), or left out when none does
(skipped): a cut elsewhere would teach the model a reply that stops mid-turn. The validation
split is `data.val_path` / `data.val_split`, else the last `data.val_fraction` of the
conversations.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmcli.cache import default_cache_dir
from llmcli.claim import claimed
from llmcli.data.chat_template import CHAT_TOKENS, ChatTemplate, chat_template
from llmcli.data.conversations import (
    ConversationEncoder,
    Messages,
    add_chat_tokens,
    check_messages,
    read_jsonl,
)
from llmcli.data.corpus import _load_dataset, resolve_files, rows_to_train, skipped_rows_note
from llmcli.data.prepared import (
    ChatData,
    ChatSplit,
    TokenData,
    cache_folder,
    read_cache_json,
    token_dtype,
)
from llmcli.data.tokenizer import EOT, Tokenizer, special_tokens, train_tokenizer
from llmcli.errors import InputError, describe_os_error
from llmcli.fileio import atomic_path, atomic_write_json
from llmcli.progress import counted

if TYPE_CHECKING:
    from llmcli.config import DataConfig

log = logging.getLogger(__name__)

# Part of every chat cache key: bump it when what is cached changes. v2: templates read the
# special tokens, and one without {% generation %} marks its assistant turns by the prefix rule.
FORMAT_VERSION = "llmcli-chat-v2"
MESSAGES_COLUMN = "messages"  # a dataset's column of conversations


@dataclass
class Conversations:
    """One source's checked conversations, where each is ("file line N"), and how messages
    name the source."""

    rows: list[Messages]
    wheres: list[str]
    label: str


# --- Reading conversations -----------------------------------------------------------------


def _read_files(spec: str, key: str) -> Conversations:
    files = resolve_files(spec, key, suffix=".jsonl", what="JSONL")
    read = [row for path in files for row in read_jsonl(path)]
    return Conversations([m for m, _ in read], [w for _, w in read], f"{key} ({spec!r})")


def _read_dataset(spec: str, split: str, key: str, cache: Path) -> Conversations:
    """The `messages` column of a `datasets` source (local json/jsonl files need no network)."""
    dataset = _load_dataset(spec, split, key, cache)
    label = f"{key} ({spec!r}, split {split!r})"
    if MESSAGES_COLUMN not in dataset.column_names:
        raise InputError(
            f"{label} has no {MESSAGES_COLUMN!r} column (its columns are: "
            f"{', '.join(dataset.column_names)}): data.format chat reads conversations from "
            f'rows of {{"messages": [{{"role", "content"}}, ...]}}.'
        )
    wheres = [f"{label} row {i}" for i in range(dataset.num_rows)]
    rows = [
        check_messages(messages, where)
        for messages, where in zip(dataset[MESSAGES_COLUMN], wheres, strict=True)
    ]
    return Conversations(rows, wheres, label)


def read_conversations(
    data_cfg: DataConfig, cache: Path
) -> tuple[Conversations, Conversations | None]:
    """The training conversations and the separate validation ones (None: the last
    `val_fraction` of the training ones are held out).

    Raises:
        InputError: a missing source, a malformed row (its file and line, or its dataset row),
            an unknown role, roles out of order, a conversation with no assistant turn.
    """
    if data_cfg.path is not None:
        if data_cfg.val_split is not None:
            raise InputError(
                f"data.val_split ({data_cfg.val_split!r}) applies to data.dataset only; with "
                "data.path give a separate validation file as data.val_path."
            )
        train = _read_files(data_cfg.path, "data.path")
        val = _read_files(data_cfg.val_path, "data.val_path") if data_cfg.val_path else None
    else:
        assert data_cfg.dataset is not None  # DataConfig.validate: one of them is set
        train = _read_dataset(data_cfg.dataset, data_cfg.split, "data.dataset", cache)
        val = None
        if data_cfg.val_path is not None or data_cfg.val_split is not None:
            spec = data_cfg.val_path or data_cfg.dataset
            key = "data.val_path" if data_cfg.val_path else "data.dataset"
            val = _read_dataset(spec, data_cfg.val_split or data_cfg.split, key, cache)
    for source in (train, val):
        if source is not None and not source.rows:
            raise InputError(f"{source.label} holds no conversations: add some.")
    return train, val


def _content_hash(conversations: Conversations, template: ChatTemplate) -> str:
    """The cache key of a source's conversations as the template renders them."""
    h = hashlib.sha256(f"{FORMAT_VERSION}\0{template.source}\0".encode())
    for messages in conversations.rows:
        h.update(json.dumps(messages, ensure_ascii=False, sort_keys=True).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


# --- The tokenizer ----------------------------------------------------------------------------


def _plain_texts(template: ChatTemplate, sources: list[Conversations]) -> Iterator[str]:
    """Each conversation as the template renders it, without the chat tokens and the end of
    text (special tokens of the tokenizer, they are not text to learn merges or characters
    from). The template reads the special tokens of the tokenizer to be trained, whose end of
    text is `EOT` for char and BPE alike."""
    special = special_tokens(EOT)
    for source in sources:
        for messages, where in zip(source.rows, source.wheres, strict=True):
            try:
                text = template.render(messages, False, **special).text
            except InputError as exc:
                raise InputError(f"{where}: {exc}") from None
            for token in (*CHAT_TOKENS, EOT):
                text = text.replace(token, "")
            yield text


def _chat_tokenizer(
    data_cfg: DataConfig,
    template: ChatTemplate,
    sources: list[Conversations],
    given: Tokenizer | None,
) -> tuple[Tokenizer, dict | None]:
    """The tokenizer conversations are encoded with, and how it was made (for meta.json).

    A tokenizer passed in (a resumed run's, a reader's) is used as is and must hold the chat
    tokens; otherwise `data.tokenizer`'s (trained on the conversations' text, or loaded) gets
    them added at new ids after its last (`add_chat_tokens`).
    """
    if given is not None:
        hf = getattr(given, "hf", None)
        if hf is None or any(hf.token_to_id(t) is None for t in CHAT_TOKENS):
            raise InputError(
                f"data.format is chat, but the run's tokenizer has no chat tokens "
                f"({', '.join(CHAT_TOKENS)}): the run was trained on plain text. Fine-tune it "
                "in a new run instead: --set train.init_from=RUN (a new --out folder)."
            )
        return given, None
    texts = _plain_texts(template, sources) if data_cfg.tokenizer in ("char", "bpe") else []
    base = train_tokenizer(data_cfg, texts)
    tok = add_chat_tokens(base)
    kind = data_cfg.tokenizer if data_cfg.tokenizer in ("char", "bpe") else "given"
    about: dict[str, Any] = {"kind": kind, "vocab_size": tok.vocab_size}
    if kind == "given":
        about["name"] = data_cfg.tokenizer
    about["chat_tokens_added"] = tok.vocab_size - base.vocab_size
    return tok, about


# --- The cache --------------------------------------------------------------------------------


def _cache_paths(folder: Path, key: str) -> dict[str, Path]:
    return {
        "tokens": folder / f"{key}.bin",
        "mask": folder / f"{key}.mask.bin",
        "offsets": folder / f"{key}.offsets.bin",
        "meta": folder / f"{key}.json",
    }


def _whole(paths: dict[str, Path], dtype: np.dtype) -> dict | None:
    """The cache record, if it and the three files it describes are whole."""
    meta = read_cache_json(paths["meta"])
    if not meta or meta.get("format") != FORMAT_VERSION:
        return None
    n, rows = meta.get("n_tokens"), meta.get("n_conversations")
    if not (isinstance(n, int) and isinstance(rows, int)):
        return None
    sizes = {"tokens": n * dtype.itemsize, "mask": n, "offsets": (rows + 1) * 8}
    for part, size in sizes.items():
        if not paths[part].is_file() or paths[part].stat().st_size != size:
            return None
    return meta


def _encode_all(encoder: ConversationEncoder, source: Conversations) -> Iterator[Any]:
    for messages, where in zip(source.rows, source.wheres, strict=True):
        try:
            yield encoder.encode(messages)
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None


def _write_cache(
    paths: dict[str, Path], encoded: Iterable[Any], dtype: np.dtype, source_hash: str, label: str
) -> None:
    """Encode into the three files (each atomically), then write the record that they are whole."""
    offsets = [0]
    with (
        atomic_path(paths["tokens"]) as tokens_tmp,
        atomic_path(paths["mask"]) as mask_tmp,
        open(tokens_tmp, "wb") as tokens_f,
        open(mask_tmp, "wb") as mask_f,
    ):
        for conversation in encoded:
            tokens_f.write(conversation.ids.astype(dtype).tobytes())
            mask_f.write(conversation.mask.astype(np.uint8).tobytes())
            offsets.append(offsets[-1] + len(conversation.ids))
    with atomic_path(paths["offsets"]) as tmp:
        np.asarray(offsets, dtype=np.int64).tofile(tmp)
    record = {
        "format": FORMAT_VERSION,
        "dtype": dtype.name,
        "n_tokens": offsets[-1],
        "n_conversations": len(offsets) - 1,
        "source_hash": source_hash,
        "source": label,
    }
    atomic_write_json(paths["meta"], record)


def _cached(
    encoder: ConversationEncoder, source: Conversations, source_hash: str, cache: Path
) -> tuple[dict[str, Path], int]:
    """The cache files of a source's conversations (written unless whole already), and how
    many conversations they hold."""
    tok_hash = hashlib.sha256(encoder.tokenizer.to_json().encode("utf-8")).hexdigest()
    key = hashlib.sha256(f"{FORMAT_VERSION}\0{source_hash}\0{tok_hash}".encode()).hexdigest()[:40]
    paths = _cache_paths(cache / "tokens", key)
    dtype = token_dtype(encoder.tokenizer.vocab_size)
    meta = _whole(paths, dtype)
    if meta is None:  # another prepare of the same entry may be writing it: wait for it
        lock = cache / "tokens" / f"{key}.lock"
        with claimed(lock, f"the token cache entry '{paths['tokens']}'", wait=True):
            meta = _whole(paths, dtype)
            if meta is None:
                return _encode_into_cache(encoder, source, source_hash, paths, dtype)
    log.info(
        "%s: %s, from the token cache",
        source.label,
        counted(meta["n_conversations"], "conversation"),
    )
    return paths, meta["n_conversations"]


def _encode_into_cache(
    encoder: ConversationEncoder,
    source: Conversations,
    source_hash: str,
    paths: dict[str, Path],
    dtype: np.dtype,
) -> tuple[dict[str, Path], int]:
    """Encode `source`'s conversations into the cache files `paths`."""
    log.info(
        "encoding %s of %s into %s",
        counted(len(source.rows), "conversation"),
        source.label,
        paths["tokens"],
    )
    try:
        _write_cache(paths, _encode_all(encoder, source), dtype, source_hash, source.label)
    except OSError as exc:
        raise InputError(
            f"cannot write the token cache '{paths['tokens']}' ({describe_os_error(exc)}): set "
            "data.cache_dir or $LLMCLI_CACHE to a writable folder with room."
        ) from None
    return paths, len(source.rows)


# --- Windows ----------------------------------------------------------------------------------


def conversation_windows(
    mask: np.ndarray, offsets: np.ndarray, context_length: int
) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Each conversation's window: `(starts (K,), lengths (K,), counts)`.

    A conversation of at most `context_length + 1` tokens is kept whole; a longer one ends
    after the last assistant turn (its end-of-turn token) that fits, or is skipped when none
    does. `mask` is `(N,)` over the conversations one after another, `offsets` `(R + 1,)`.
    """
    limit = context_length + 1
    starts, stops = offsets[:-1], offsets[1:]
    written = np.asarray(mask, dtype=bool)
    following = np.zeros_like(written)
    following[:-1] = written[1:]
    following[stops[stops > 0] - 1] = False  # a conversation's last token ends its turn
    turn_ends = np.flatnonzero(written & ~following) + 1  # one past each turn's last token
    last = np.searchsorted(turn_ends, starts + limit, side="right") - 1
    end = turn_ends[np.maximum(last, 0)] if len(turn_ends) else np.zeros_like(starts)
    fits = (last >= 0) & (end > starts)
    whole = stops - starts <= limit
    lengths = np.where(whole, stops - starts, np.where(fits, end - starts, 0))
    # A window must hold a token to learn (not its first token, which nothing predicts).
    written_before = np.concatenate([[0], np.cumsum(written, dtype=np.int64)])  # (N + 1,)
    first = np.minimum(starts + 1, starts + lengths)
    learned = (lengths > 1) & (written_before[starts + lengths] - written_before[first] > 0)
    truncated = int(np.sum(~whole & fits & learned))
    counts = {
        "conversations": int(len(starts)),
        "kept": int(np.sum(whole & learned)),
        "truncated": truncated,
        "skipped": int(np.sum(~learned)),
    }
    return starts[learned].astype(np.int64), lengths[learned].astype(np.int64), counts


def _split(paths: dict[str, Path], dtype: np.dtype, rows: slice, context_length: int) -> ChatSplit:
    """The conversations `rows` of a cache entry as a split (memory maps, and windows)."""
    every = np.fromfile(paths["offsets"], dtype=np.int64)  # (R + 1,)
    offsets = every[rows.start : None if rows.stop is None else rows.stop + 1]
    lo, hi = int(offsets[0]), int(offsets[-1])
    tokens = np.memmap(
        paths["tokens"], dtype=dtype, mode="r", offset=lo * dtype.itemsize, shape=(hi - lo,)
    )
    mask = np.memmap(paths["mask"], dtype=np.uint8, mode="r", offset=lo, shape=(hi - lo,))
    starts, lengths, counts = conversation_windows(mask, offsets - lo, context_length)
    # a kept conversation's window starts where it does (every conversation holds tokens)
    skipped = np.flatnonzero(~np.isin(offsets[:-1] - lo, starts)).tolist()
    return ChatSplit(tokens, mask, starts, lengths, counts, skipped)


def _check_windows(
    name: str, split: ChatSplit, template: ChatTemplate, context_length: int, wheres: list[str]
) -> None:
    """Refuse a split with nothing to learn from; warn of the conversations left out, by
    `wheres` (each of the split's rows' place, "file line N")."""
    if not split.mask.any():  # nothing to learn however long the context
        raise InputError(
            f"{template.origin} marks none of the {name} split's tokens as the assistant's: "
            "put each assistant message and its end-of-turn token inside {% generation %}"
            "...{% endgeneration %}, as the built-in template does, for the loss to be on them."
        )
    why = (
        f"no assistant turn of theirs ends within model.context_length + 1 "
        f"({counted(context_length + 1, 'token')})"
    )
    fix = "To learn from them, raise model.context_length or shorten them."
    skipped = [wheres[row] for row in split.skipped_rows]
    note = skipped_rows_note(name, ("conversation", "conversations"), skipped, why, fix)
    if len(split.starts) == 0:
        raise InputError(f"nothing left to learn from: {note}")
    if note:
        log.warning("%s", note)


def _describe(name: str, counts: dict[str, int]) -> str:
    return (
        f"{name} {counted(counts['conversations'], 'conversation')}: {counts['kept']:,} kept, "
        f"{counts['truncated']:,} truncated at a turn's end, {counts['skipped']:,} skipped"
    )


def prepare_chat_data(
    data_cfg: DataConfig,
    context_length: int,
    tokenizer: Tokenizer | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> TokenData:
    """Read the conversations, make the tokenizer unless one is given, encode them once into the
    cache, and cut their windows for `context_length`.

    Args:
        data_cfg: the `data` config section (`format: chat`).
        context_length: the model's window; a window is at most this + 1 tokens.
        tokenizer: a tokenizer to use as is, holding the chat tokens (a resumed run's).
        cache_dir: the cache folder; default `data_cfg.cache_dir`, else `default_cache_dir()`.

    Returns:
        `TokenData` whose `train`/`val` are the splits' ids (memory maps) and whose `chat`
        holds their masks and windows (`ChatData`).

    Raises:
        InputError: a missing source; a malformed row, role or order (file and line); a
            template that is not valid Jinja or does not render; a given tokenizer without
            the chat tokens; a split with no conversation that fits.
    """
    cache = cache_folder(Path(cache_dir or data_cfg.cache_dir or default_cache_dir()))
    template = chat_template(data_cfg.chat_template)
    train_src, val_src = read_conversations(data_cfg, cache)
    sources = [train_src] + ([val_src] if val_src is not None else [])
    hashes = [_content_hash(source, template) for source in sources]
    tok, training = _chat_tokenizer(data_cfg, template, sources, tokenizer)
    encoder = ConversationEncoder(template, tok)
    dtype = token_dtype(tok.vocab_size)
    cached = [_cached(encoder, s, h, cache) for s, h in zip(sources, hashes, strict=True)]
    (train_paths, n_rows) = cached[0]
    n_train = n_rows
    if val_src is None:
        n_train = rows_to_train(n_rows, data_cfg.val_fraction, train_src.label, "conversations")
        train = _split(train_paths, dtype, slice(0, n_train), context_length)
        val = _split(train_paths, dtype, slice(n_train, None), context_length)
    else:
        train = _split(train_paths, dtype, slice(0, None), context_length)
        val = _split(cached[1][0], dtype, slice(0, None), context_length)
    val_wheres = train_src.wheres[n_train:] if val_src is None else val_src.wheres
    _check_windows("train", train, template, context_length, train_src.wheres)
    _check_windows("validation", val, template, context_length, val_wheres)
    chat = ChatData(template, train, val, pad_id=encoder.end_id)
    log.info(
        "chat data: %s; %s", _describe("train", train.counts), _describe("validation", val.counts)
    )
    files = [p for paths, _ in cached for name, p in paths.items() if name != "meta"]
    return TokenData(
        tokenizer=tok,
        train=train.tokens,
        val=val.tokens,
        source_hash=hashlib.sha256("\0".join(hashes).encode()).hexdigest(),
        cache_files=files,
        tokenizer_training=training,
        chat=chat,
    )
