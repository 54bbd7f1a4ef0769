"""Training the tokenizer once per corpus: a trained tokenizer cached by its text and settings.

`trained_tokenizer` trains the configured tokenizer (`data.tokenizer: char|bpe`) on the sources,
or takes a given one as it is, and caches a trained one in the cache folder's
`tokenizers/<key>.json`, keyed by the corpus's content hash and the tokenizer's settings, with how
it was trained in `<key>.training.json` (`TokenData.tokenizer_training`), so that a rerun does
not train again. Two processes training one entry at once take turns (`llmcli.claim`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from llmcli.claim import claimed
from llmcli.data.corpus import Source
from llmcli.data.prepared import read_cache_json
from llmcli.data.token_cache import FORMAT_VERSION, PROGRESS_MIN
from llmcli.data.tokenizer import Tokenizer, load_tokenizer, train_tokenizer
from llmcli.errors import InputError
from llmcli.fileio import atomic_write_text
from llmcli.progress import Progress, format_bytes

if TYPE_CHECKING:
    from llmcli.config import DataConfig

log = logging.getLogger(__name__)


def trained_tokenizer(
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
