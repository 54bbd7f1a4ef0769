"""The token cache: a source's tokens, encoded once into a file keyed by content and tokenizer.

`cached_tokens` returns the raw token file (uint16 when the vocabulary fits, else uint32) of a
source (`llmcli.data.corpus`) and a tokenizer under the cache folder's `tokens/<key>.bin`, with its
record in `<key>.json`: reused when it is there whole, else written, so an unchanged corpus is not
tokenized again and a changed one is. `llmcli.data.tokens.prepare_data` maps the files as the
splits. Two processes preparing one entry at once take turns (`llmcli.claim`): the second waits
for the first, then reads its file. A stream (`data.streaming`) is tokenized into
`tokens/<key>.parts/` first, piece by piece, so that an interrupted prepare continues where it
stopped (`_tokenize_stream`); the pieces become `<key>.bin` at its end.

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
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from llmcli.claim import claimed
from llmcli.data.corpus import FileSource, Source, StreamSource
from llmcli.data.prepared import read_cache_json, token_dtype
from llmcli.data.tokenizer import EOT, CharTokenizer, Tokenizer, separator_ids
from llmcli.errors import InputError, describe_os_error
from llmcli.fileio import atomic_path, atomic_write_json, atomic_write_text, remove_stale_temp_files
from llmcli.progress import Progress, format_count

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


def cached_tokens(tok: Tokenizer, source: Source, source_hash: str, cache_dir: Path) -> Path:
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
