"""From text sources to batches of token windows, through a memory-mapped token cache.

`prepare_data` reads the configured text (`data.path`: a file, a folder of `.txt` files or a glob;
or `data.dataset`: a Hugging Face `datasets` source; see `llmcli.data.corpus`), trains the tokenizer
unless one is given, and tokenizes the text once into a binary token file (uint16 when the
vocabulary fits, else uint32) under a cache folder. The file is keyed by a hash of the source
content and of the tokenizer, so an unchanged corpus is not tokenized again and a changed one is.
`TokenData` (`llmcli.data.prepared`) holds the splits as `np.memmap`s of that file;
`llmcli.data.windows.WindowReader` reads windows of them from the file (`os.pread`), so memory
does not grow with the corpus, for the batches (`llmcli.data.batches`). Conversations
(`data.format: chat`) are read and encoded by `llmcli.data.chat` into the same cache.

Cache folder: the `cache_dir` argument, else `data.cache_dir`, else `$LLMCLI_CACHE`, else
`$XDG_CACHE_HOME/llmcli`, else `~/.cache/llmcli`. It holds `tokens/<key>.bin` (+ `.json`
metadata), `tokenizers/<key>.json` (trained tokenizers, so that a rerun does not train again) and
`datasets/` (the `datasets` library's Arrow cache for local json/csv/parquet files; hub datasets
use that library's own cache). Deleting it is always safe. A stream (`data.streaming`) is
tokenized into `tokens/<key>.parts/` first, piece by piece, so that an interrupted prepare
continues where it stopped (`_tokenize_stream`); the pieces become `<key>.bin` at its end. Two
processes preparing one entry at once take turns (`llmcli.claim`): the second waits for the
first, then reads its file.

Documents (files of a folder or glob, rows of a dataset) are joined with the end-of-text token
(BPE) or a newline (char). Long documents are cut into pieces at line boundaries
(`<non-space>\\n<non-space>`) and encoded in parallel batches; for our char and byte-level BPE
tokenizers this gives exactly the tokens of encoding the whole text at once. (A foreign
tokenizer.json whose normalizer or pre-tokenizer treats the start of a text specially, e.g. one
that prepends "▁", may encode a piece's first word differently.)
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from llmcli.cache import default_cache_dir
from llmcli.claim import claimed
from llmcli.data.chat import prepare_chat_data
from llmcli.data.corpus import FileSource, Source, StreamSource, open_sources
from llmcli.data.prepared import (
    TokenData,
    cache_folder,
    read_cache_json,
    token_dtype,
)
from llmcli.data.tokenizer import (
    EOT,
    CharTokenizer,
    Tokenizer,
    load_tokenizer,
    separator_ids,
    train_tokenizer,
)
from llmcli.errors import InputError, describe_os_error
from llmcli.fileio import (
    atomic_path,
    atomic_write_json,
    atomic_write_text,
    remove_stale_temp_files,
)
from llmcli.progress import Progress, format_bytes, format_count

if TYPE_CHECKING:
    from llmcli.config import DataConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = "llmcli-tokens-v1"  # part of every cache key: bump it when the format changes
PIECE_CHARS = 4096  # characters handed to one encode call (small pieces balance the threads)
BATCH_CHARS = 4 << 20  # characters per encode_batch call
PROGRESS_MIN = 16 << 20  # show a progress bar from this many bytes (or 100k dataset rows)
# Rows per piece of a stream's resumable cache: the most work an interrupted prepare loses.
STREAM_PIECE_ROWS = 20_000
STREAM_REPORT_SECONDS = 30  # off a terminal, a stream's progress line at most this often
# Safe cuts for encoding a text in pieces: after a newline between two non-space characters,
# else before a space between two non-space characters. GPT-2's pre-tokenizer regex never joins
# text across either point, so the tokens are the same as for the whole text.
_LINE_CUT = re.compile(r"\S\n(?=\S)")
_SPACE_CUT = re.compile(r"\S(?= \S)")


def _find_cut(text: str, lo: int, hi: int) -> int | None:
    for pattern in (_LINE_CUT, _SPACE_CUT):
        m = pattern.search(text, lo, hi)
        if m:
            return m.end()
    return None


def _pieces(blocks: Iterable[str], size: int | None = None) -> Iterator[str]:
    """Cut one document's text (given in blocks) into pieces of about `size` (default
    `PIECE_CHARS`) characters at safe cuts (see `_LINE_CUT`), so that encoding the pieces
    equals encoding the whole."""
    size = size or PIECE_CHARS
    rest = ""
    for block in blocks:
        text = rest + block if rest else block
        pos = 0
        while len(text) - pos > size:
            end = _find_cut(text, pos + size, min(len(text), pos + 8 * size))
            if end is None:
                if len(text) - pos < 8 * size:
                    break  # wait for more text: a cut may come in the next block
                # No newline or space in 7 * size characters: cut mid-word (a few tokens at the
                # cut may differ from encoding the text whole).
                end = pos + 4 * size
            yield text[pos:end]
            pos = end
        rest = text[pos:]
    if rest:
        yield rest


def _encode_many(tok: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    if isinstance(tok, CharTokenizer) and not any(EOT in text for text in texts):
        # One vectorised call; a char tokenizer gives exactly one token per character.
        flat = tok.encode_array("".join(texts))
        return np.split(flat, np.cumsum([len(t) for t in texts[:-1]]))
    return [np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(texts)]


def _tokenize_to_file(tok: Tokenizer, source: Source, path: Path, dtype: np.dtype) -> int:
    """Tokenize `source` into the raw token file `path` (written atomically); returns its
    number of tokens."""
    size = source.size()
    is_files = isinstance(source, FileSource)
    bar = Progress(
        size,
        desc=f"tokenizing {source.label}",
        unit="B" if is_files else "rows",
        enabled=size >= (PROGRESS_MIN if is_files else 100_000),
        tenths=True,
        unit_scale=is_files,
    )
    with atomic_path(path) as tmp, open(tmp, "wb") as f, bar:
        _, n_tokens = _write_documents(tok, source.documents(bar.update), f, dtype)
    return n_tokens


def _write_documents(
    tok: Tokenizer,
    documents: Iterable[Iterable[str]],
    f: BinaryIO,
    dtype: np.dtype,
    lead: bool = False,
) -> tuple[int, int]:
    """Encode `documents` (each given in text blocks) joined by the separator
    (`separator_ids`) and write the ids to the open file `f`; returns (documents, tokens)
    written. `lead`: begin with a separator too, as a piece of a stream that follows earlier
    rows does."""
    sep = np.asarray(separator_ids(tok), dtype=np.int64)
    n_documents = n_tokens = 0
    batch: list[str | None] = []  # pieces of text, None where a separator goes
    chars = 0

    def flush() -> None:
        nonlocal n_tokens, chars
        texts = [t for t in batch if t is not None]
        encoded = iter(_encode_many(tok, texts) if texts else [])
        parts = [sep if t is None else next(encoded) for t in batch]
        if parts:
            ids = np.concatenate(parts)
            if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(dtype).max):
                raise RuntimeError(
                    f"token id {ids.max()} does not fit {dtype} (vocab_size "
                    f"{tok.vocab_size}): the tokenizer reports a wrong size"
                )
            f.write(ids.astype(dtype).tobytes())
            n_tokens += ids.size
        batch.clear()
        chars = 0

    for document in documents:
        if n_documents or lead:
            batch.append(None)
        n_documents += 1
        for piece in _pieces(document):
            batch.append(piece)
            chars += len(piece)
            if chars >= BATCH_CHARS:
                flush()
    flush()
    return n_documents, n_tokens


# --- A stream's resumable cache -------------------------------------------------------------


def _parts_folder(bin_path: Path) -> Path:
    """Where a stream's token file `<key>.bin` is written in pieces: `<key>.parts/`."""
    return bin_path.with_suffix(".parts")


def _tokenize_stream(
    tok: Tokenizer,
    source: StreamSource,
    path: Path,
    dtype: np.dtype,
    piece_rows: int | None = None,
) -> int:
    """Tokenize a stream into the raw token file `path`, resumably; returns its number of
    tokens.

    Rows are tokenized as they arrive into pieces `<key>.parts/000000.bin`, `000001.bin`, ...
    of `piece_rows` rows each (default `STREAM_PIECE_ROWS`); each piece is written atomically,
    then recorded in `<key>.parts/progress.json` (the rows and tokens done, and each piece's;
    written atomically too). Run again with the same key after an interruption or a kill, it
    keeps the pieces recorded, skips their rows and goes on. When the stream ends, the pieces
    are joined into `path` (atomically); the caller removes the folder once `path`'s metadata
    is written. A piece that does not start at row 0 begins with the separator, so `path`
    holds exactly the tokens of the rows tokenized in one go, as `_tokenize_to_file` would.
    """
    piece_rows = piece_rows or STREAM_PIECE_ROWS
    parts = _parts_folder(path)
    pieces = _recorded_pieces(parts, dtype)  # (rows, tokens) of each piece kept
    parts.mkdir(exist_ok=True)
    remove_stale_temp_files(parts)  # a killed run's half-written piece
    rows = sum(n for n, _ in pieces)
    if pieces:
        log.info(
            "continuing %s after row %d (%d pieces in %s)", source.label, rows, len(pieces), parts
        )
    size = source.size()
    bar = Progress(
        size,
        desc=f"tokenizing {source.label}",
        unit="rows",
        initial=rows,
        enabled=size is None or size >= 100_000,
        tenths=True,
    )
    documents = source.documents(bar.update, skip=rows)
    next_report = time.monotonic() + STREAM_REPORT_SECONDS
    with bar:
        while True:
            piece = parts / f"{len(pieces):06d}.bin"
            with atomic_path(piece) as tmp, open(tmp, "wb") as f:
                chunk = itertools.islice(documents, piece_rows)
                n_rows, n_tokens = _write_documents(tok, chunk, f, dtype, lead=rows > 0)
            if n_rows == 0:  # the stream ended with the last piece
                piece.unlink()
                break
            pieces.append((n_rows, n_tokens))
            rows += n_rows
            tokens = sum(n for _, n in pieces)
            record = {"rows": rows, "tokens": tokens, "pieces": [list(p) for p in pieces]}
            atomic_write_json(parts / "progress.json", record)
            if bar.live or time.monotonic() >= next_report:  # a line per piece: too many
                bar.report({"tokens": format_count(tokens)})
                next_report = time.monotonic() + STREAM_REPORT_SECONDS
            if n_rows < piece_rows:
                break
    _check_stream_text(source, rows, sum(n for _, n in pieces), len(separator_ids(tok)))
    with atomic_path(path) as tmp, open(tmp, "wb") as out:
        for i in range(len(pieces)):
            with open(parts / f"{i:06d}.bin", "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
    return sum(n for _, n in pieces)


def _recorded_pieces(parts: Path, dtype: np.dtype) -> list[tuple[int, int]]:
    """The (rows, tokens) of each piece `parts/progress.json` records, if every piece is there
    whole; else none (the stream starts over)."""
    record = read_cache_json(parts / "progress.json")
    if record is None:
        return []
    try:
        pieces = [(int(rows), int(tokens)) for rows, tokens in record.get("pieces")]
    except (TypeError, ValueError):
        pieces = None
    for i, (_, tokens) in enumerate(pieces or []):
        piece = parts / f"{i:06d}.bin"
        if not piece.is_file() or piece.stat().st_size != tokens * dtype.itemsize:
            pieces = None
            break
    if pieces is None:
        log.warning("ignoring the damaged token pieces in %s: starting the stream over", parts)
        return []
    return pieces


def _check_stream_text(source: StreamSource, rows: int, tokens: int, sep: int) -> None:
    """Refuse a stream with no rows, or with rows but no text (only separators)."""
    if rows == 0:
        raise InputError(f"{source.label}: the corpus is empty (the stream has no rows).")
    if tokens == (rows - 1) * sep:
        raise InputError(
            f"{source.label}: the corpus is empty ({rows} rows, no text in column "
            f"{source.column!r})."
        )


def _cached_tokens(tok: Tokenizer, source: Source, source_hash: str, cache_dir: Path) -> Path:
    """The token file for (source, tokenizer): reused when present and whole, else written."""
    tok_hash = hashlib.sha256(tok.to_json().encode("utf-8")).hexdigest()
    key = hashlib.sha256(f"{FORMAT_VERSION}\0{source_hash}\0{tok_hash}".encode()).hexdigest()[:40]
    folder = cache_dir / "tokens"
    folder.mkdir(parents=True, exist_ok=True)
    bin_path, meta_path = folder / f"{key}.bin", folder / f"{key}.json"
    dtype = token_dtype(tok.vocab_size)
    n_tokens = _whole_tokens(bin_path, meta_path, dtype)
    if n_tokens is None:  # another prepare of the same entry may be writing it: wait for it
        with claimed(folder / f"{key}.lock", f"the token cache entry '{bin_path}'", wait=True):
            n_tokens = _whole_tokens(bin_path, meta_path, dtype)
            if n_tokens is None:
                return _write_tokens(tok, source, source_hash, tok_hash, bin_path, dtype)
    log.info("%s: %s tokens, from the token cache", source.label, format_count(n_tokens))
    return bin_path


def _whole_tokens(bin_path: Path, meta_path: Path, dtype: np.dtype) -> int | None:
    """The number of tokens in the cached token file, if it is there whole; else None."""
    meta = _read_meta(meta_path)
    if meta and bin_path.exists() and bin_path.stat().st_size == meta["n_tokens"] * dtype.itemsize:
        return meta["n_tokens"]
    return None


def _write_tokens(
    tok: Tokenizer,
    source: Source,
    source_hash: str,
    tok_hash: str,
    bin_path: Path,
    dtype: np.dtype,
) -> Path:
    """Tokenize `source` into the cache's `bin_path`, then write its record beside it."""
    log.info("tokenizing %s into %s", source.label, bin_path)
    streamed = isinstance(source, StreamSource)
    try:
        if streamed:
            n_tokens = _tokenize_stream(tok, source, bin_path, dtype)
        else:
            n_tokens = _tokenize_to_file(tok, source, bin_path, dtype)
        meta = {
            "format": FORMAT_VERSION,
            "dtype": dtype.name,
            "n_tokens": n_tokens,
            "source_hash": source_hash,
            "tokenizer_sha256": tok_hash,
            "source": source.label,
        }
        atomic_write_text(bin_path.with_suffix(".json"), json.dumps(meta, indent=1))
        if streamed:  # the file and its metadata are whole: its pieces are no longer needed
            shutil.rmtree(_parts_folder(bin_path), ignore_errors=True)
    except OSError as exc:  # reading the corpus raises InputError: this is the cache's
        raise InputError(
            f"cannot write the token cache '{bin_path}' ({describe_os_error(exc)}): set "
            "data.cache_dir or $LLMCLI_CACHE to a writable folder with room."
        ) from None
    return bin_path


def _read_meta(path: Path) -> dict | None:
    """A token file's record, if it is one of this format."""
    meta = read_cache_json(path)
    ok = meta is not None and meta.get("format") == FORMAT_VERSION
    return meta if ok and isinstance(meta.get("n_tokens"), int) else None


def _trained_tokenizer(
    data_cfg: DataConfig, sources: list[Source], source_hash: str, cache_dir: Path
) -> tuple[Tokenizer, dict]:
    """Train the configured tokenizer, or reuse the one trained before on the same text; with
    how it was trained (`TokenData.tokenizer_training`).

    A char tokenizer reads every source (validation included, as nanoGPT's char preparation
    does, so that every validation character is encodable). BPE reads at most
    `data.tokenizer_sample` bytes spread evenly over them, each source its share: its word
    counts, which it holds whole, grow with the text it reads, not with the corpus.
    """
    if data_cfg.tokenizer not in ("char", "bpe"):  # a tokenizer.json or a Hub name, as is
        return train_tokenizer(data_cfg, []), {"kind": "given", "name": data_cfg.tokenizer}
    sizes = [source.text_bytes() for source in sources]
    corpus = _total(sizes)
    limit = data_cfg.tokenizer_sample_bytes if data_cfg.tokenizer == "bpe" else None
    sampled = limit is not None and (corpus is None or corpus > limit)
    # "char-v2": char tokenizers gained an end-of-text token; a cached older one is not reused.
    spec = f"bpe-{data_cfg.vocab_size}" if data_cfg.tokenizer == "bpe" else "char-v2"
    spec += f"-sample-{limit}" if sampled else ""
    key = hashlib.sha256(f"{FORMAT_VERSION}\0{source_hash}\0{spec}".encode()).hexdigest()[:40]
    path = cache_dir / "tokenizers" / f"{key}.json"
    about_path = path.with_name(f"{key}.training.json")
    fed = (min(limit, corpus) if corpus is not None else limit) if sampled else corpus
    cached = _cached_tokenizer(path, about_path, data_cfg, fed, corpus, sampled)
    if cached is not None:
        return cached
    # Another prepare of the same corpus may be training it: wait for it, then read its result.
    with claimed(path.with_suffix(".lock"), f"the tokenizer cache entry '{path}'", wait=True):
        cached = _cached_tokenizer(path, about_path, data_cfg, fed, corpus, sampled)
        if cached is not None:
            return cached
        return _train_and_cache(data_cfg, sources, sizes, limit, sampled, path, about_path)


def _cached_tokenizer(
    path: Path,
    about_path: Path,
    data_cfg: DataConfig,
    fed: int | None,
    corpus: int | None,
    sampled: bool,
) -> tuple[Tokenizer, dict] | None:
    """The tokenizer cached at `path` with its training record, if there is a readable one."""
    if not path.exists():
        return None
    try:
        tok = load_tokenizer(path)
    except InputError:
        log.warning("ignoring unreadable cached tokenizer %s", path)
        return None
    # A tokenizer cached before its record was kept: the record it would have had.
    guess = _training_record(data_cfg, tok, fed, corpus, sampled)
    about = read_cache_json(about_path)
    return tok, about if about and isinstance(about.get("kind"), str) else guess


def _train_and_cache(
    data_cfg: DataConfig,
    sources: list[Source],
    sizes: list[int | None],
    limit: int | None,
    sampled: bool,
    path: Path,
    about_path: Path,
) -> tuple[Tokenizer, dict]:
    """Train the tokenizer on `sources` (a sample of `limit` bytes when `sampled`) and cache it
    at `path`, with its training record at `about_path`."""
    corpus = _total(sizes)
    fed = 0

    def texts() -> Iterator[str]:
        nonlocal fed
        for source, size in zip(sources, sizes, strict=True):
            if sampled:  # each source its share of the sample
                share = limit if corpus is None else max(1, limit * size // corpus)
                pieces = _at_most(source.sample_texts(share), share)
            else:
                pieces = (block for document in source.documents() for block in document)
            for text in pieces:
                n = len(text.encode("utf-8", "surrogatepass"))
                fed += n
                bar.update(n)
                yield text
        if data_cfg.tokenizer == "bpe":  # the merges take a while longer, with no count to show
            log.info("tokenizer: read %s of text; computing the merges", format_bytes(fed))

    what = f"BPE ({data_cfg.vocab_size} tokens)" if data_cfg.tokenizer == "bpe" else "char"
    of = f"a {format_bytes(limit)} sample of " if sampled else ""
    log.info("training the %s tokenizer on %s%s", what, of, " + ".join(s.label for s in sources))
    total = limit if sampled else corpus
    shown = total is None or total >= PROGRESS_MIN
    bar = Progress(total, desc="tokenizer", unit="B", enabled=shown, tenths=True, unit_scale=True)
    with bar:
        tok = train_tokenizer(data_cfg, texts())
    about = _training_record(data_cfg, tok, fed, corpus, sampled)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(about_path, json.dumps(about))
        atomic_write_text(path, tok.to_json())
    except OSError as exc:  # only a cache: the tokenizer is trained and in hand
        log.warning("could not cache the tokenizer in %s (%s)", path, exc.strerror or exc)
    return tok, about


def _training_record(
    data_cfg: DataConfig, tok: Tokenizer, fed: int | None, corpus: int | None, sampled: bool
) -> dict:
    return {
        "kind": data_cfg.tokenizer,
        "vocab_size": tok.vocab_size,
        "trained_on_bytes": fed,
        "corpus_bytes": corpus,
        "sample": data_cfg.tokenizer_sample if sampled else None,
    }


def _total(sizes: Iterable[int | None]) -> int | None:
    sizes = list(sizes)
    return None if None in sizes else sum(sizes)


def _at_most(texts: Iterable[str], limit: int) -> Iterator[str]:
    """`texts` until about `limit` characters: a stream's sample ends where it reaches it."""
    n = 0
    for text in texts:
        if n >= limit:
            return
        n += len(text)
        yield text


# --- The prepared data ---------------------------------------------------------------------


def _check_split(name: str, n: int, context_length: int, hint: str) -> None:
    if n < context_length + 1:
        raise InputError(
            f"the {name} split has {n} tokens, but model.context_length ({context_length}) "
            f"needs at least {context_length + 1} (context_length + 1): {hint}"
        )


def _content_hashes(train: Source, val: Source | None) -> tuple[str, str | None, str]:
    """The sources' content hashes (their token files' keys), and the two's together."""
    for source in (train, val):
        if isinstance(source, FileSource) and source.size() >= PROGRESS_MIN:  # seconds per GiB
            log.info("reading %s (%s) for its cache key", source.label, format_bytes(source.size()))
    train_hash = train.content_hash()
    val_hash = val.content_hash() if val is not None else None
    return train_hash, val_hash, hashlib.sha256(f"{train_hash}\0{val_hash}".encode()).hexdigest()


def prepare_data(
    data_cfg: DataConfig,
    context_length: int,
    tokenizer: Tokenizer | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> TokenData:
    """Read the sources, train the tokenizer if none is given, tokenize once into the cache
    (`data.format: chat`: `llmcli.data.chat.prepare_chat_data`).

    Args:
        data_cfg: the `data` config section.
        context_length: the model's window; each split must hold at least this + 1 tokens.
        tokenizer: a tokenizer to use as is (a resumed run passes its saved one).
        cache_dir: the cache folder; default `data_cfg.cache_dir`, else `default_cache_dir()`.

    Returns:
        `TokenData` whose `train`/`val` are memory maps: the last `val_fraction` of the token
        stream is the validation split, unless `val_path`/`val_split` give a separate one.

    Raises:
        InputError: missing path, empty corpus, non-UTF-8 bytes (file and offset), a split
            shorter than `context_length + 1` tokens, `vocab_size` too small for BPE, a
            missing text column or split; for conversations, what `prepare_chat_data` refuses.
    """
    readers = {"text": _prepare_text, "chat": prepare_chat_data}
    read = readers.get(data_cfg.format)
    if read is None:  # pairs and prompts: `llmcli.data.preference_data`, `llmcli.data.prompts`
        reader = _ROWS_READERS.get(data_cfg.format, "its objective")
        raise InputError(
            f"data.format {data_cfg.format} holds rows for {reader}, which reads them itself: "
            "they are not a token stream."
        )
    return read(data_cfg, context_length, tokenizer, cache_dir)


# Who reads the formats that are rows, not a token stream.
_ROWS_READERS = {"preference": "train.objective dpo", "prompts": "train.objective grpo"}


def _prepare_text(
    data_cfg: DataConfig,
    context_length: int,
    tokenizer: Tokenizer | None,
    cache_dir: str | os.PathLike | None,
) -> TokenData:
    """`prepare_data` for plain text (`data.format: text`)."""
    cache = cache_folder(Path(cache_dir or data_cfg.cache_dir or default_cache_dir()))
    train_src, val_src = open_sources(data_cfg, cache)
    train_hash, val_hash, source_hash = _content_hashes(train_src, val_src)
    both = [train_src] + ([val_src] if val_src is not None else [])
    tok, training = (
        (tokenizer, None) if tokenizer else _trained_tokenizer(data_cfg, both, source_hash, cache)
    )
    dtype = token_dtype(tok.vocab_size)

    train_file = _cached_tokens(tok, train_src, train_hash, cache)
    n = train_file.stat().st_size // dtype.itemsize
    if val_src is None:
        n_train = int(n * (1 - data_cfg.val_fraction))
        _check_split(
            "train",
            n_train,
            context_length,
            f"the corpus has {n} tokens in all; add text or lower model.context_length.",
        )
        _check_split(
            "validation",
            n - n_train,
            context_length,
            f"it is the last data.val_fraction ({data_cfg.val_fraction}) of {n} tokens; "
            "raise data.val_fraction, add text or lower model.context_length.",
        )
        train = np.memmap(train_file, dtype=dtype, mode="r", shape=(n_train,))
        val = np.memmap(
            train_file, dtype=dtype, mode="r", offset=n_train * dtype.itemsize, shape=(n - n_train,)
        )
        files = [train_file]
    else:
        val_file = _cached_tokens(tok, val_src, val_hash, cache)
        n_val = val_file.stat().st_size // dtype.itemsize
        _check_split("train", n, context_length, "add text or lower model.context_length.")
        _check_split(
            "validation",
            n_val,
            context_length,
            f"{val_src.label} is too short; add text or lower model.context_length.",
        )
        train = np.memmap(train_file, dtype=dtype, mode="r", shape=(n,))
        val = np.memmap(val_file, dtype=dtype, mode="r", shape=(n_val,))
        files = [train_file, val_file]
    log.info(
        "data: %s train + %s validation tokens, vocab_size %s",
        f"{len(train):,}",
        f"{len(val):,}",
        f"{tok.vocab_size:,}",
    )
    return TokenData(
        tokenizer=tok,
        train=train,
        val=val,
        source_hash=source_hash,
        cache_files=files,
        tokenizer_training=training,
        text_bytes=_total(source.text_bytes() for source in both),
    )
