"""Preparing the data: each `data.format` to its reader, and plain text into its token splits.

`prepare_data` reads the configured text (`data.path`: a file, a folder of `.txt` files or a glob;
or `data.dataset`: a Hugging Face `datasets` source; see `llmcli.data.corpus`), trains the tokenizer
unless one is given (`llmcli.data.tokenizer_cache`), and tokenizes the text once into the token
cache (`llmcli.data.token_cache`). `TokenData` (`llmcli.data.prepared`) holds the splits as
`np.memmap`s of those files: the last `data.val_fraction` of the tokens, or a separate validation
source; `llmcli.data.windows.WindowReader` reads windows of them from the file (`os.pread`), so
memory does not grow with the corpus, for the batches (`llmcli.data.batches`). Conversations
(`data.format: chat`) are read and encoded by `llmcli.data.chat` into the same cache; pairs and
prompts are rows their objectives read themselves.

Cache folder: the `cache_dir` argument, else `data.cache_dir`, else `$LLMCLI_CACHE`, else
`$XDG_CACHE_HOME/llmcli`, else `~/.cache/llmcli`. It holds `tokens/<key>.bin` (+ `.json`
metadata), `tokenizers/<key>.json` (trained tokenizers, so that a rerun does not train again) and
`datasets/` (the `datasets` library's Arrow cache for local json/csv/parquet files; hub datasets
use that library's own cache). Deleting it is always safe.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmcli.cache import default_cache_dir
from llmcli.data.chat import prepare_chat_data
from llmcli.data.corpus import FileSource, Source, open_sources
from llmcli.data.prepared import TokenData, cache_folder, token_dtype
from llmcli.data.token_cache import PROGRESS_MIN, cached_tokens
from llmcli.data.tokenizer import Tokenizer
from llmcli.data.tokenizer_cache import trained_tokenizer
from llmcli.errors import InputError
from llmcli.progress import format_bytes

if TYPE_CHECKING:
    from llmcli.config import DataConfig

log = logging.getLogger(__name__)


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
        (tokenizer, None) if tokenizer else trained_tokenizer(data_cfg, both, source_hash, cache)
    )
    dtype = token_dtype(tok.vocab_size)

    train_file = cached_tokens(tok, train_src, train_hash, cache)
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
        val_file = cached_tokens(tok, val_src, val_hash, cache)
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
    sizes = [source.text_bytes() for source in both]
    return TokenData(
        tokenizer=tok,
        train=train,
        val=val,
        source_hash=source_hash,
        cache_files=files,
        tokenizer_training=training,
        text_bytes=None if None in sizes else sum(sizes),
    )
