"""Reading corpora: local text files, folders and globs, or Hugging Face `datasets` sources.

A source yields documents (a file, a dataset row) as iterators of text blocks, so that a corpus
larger than memory is read piece by piece; `content_hash` identifies its text for the token
cache. With `data.streaming` a dataset is a `StreamSource`, read row by row as it arrives (a
corpus larger than the disk), whose key is found without reading it. `datasets` is imported
only when a dataset source is used: it is slow to import and an installation may lack it.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmcli.config.shipped import shipped_data
from llmcli.errors import InputError
from llmcli.fileio import refuse_special_file
from llmcli.progress import counted, first_few

if TYPE_CHECKING:
    from llmcli.config import DataConfig

READ_BLOCK_BYTES = 16 << 20  # bytes read from a file at a time
SAMPLE_BLOCK_BYTES = 1 << 20  # a tokenizer sample's blocks are at most this long,
SAMPLE_BLOCKS = 256  # and at least this many, so that the sample spreads over the corpus
_GLOB_CHARS = re.compile(r"[*?\[]")
_DATASET_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_SAVE_TO_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")

OnProgress = Callable[[int], None]


class FileSource:
    """Text files read as UTF-8, one document per file, in the given order.

    Args:
        files: the files (already resolved and sorted).
        label: how messages name the source, e.g. "data.path 'corpus/'".
    """

    def __init__(self, files: list[Path], label: str) -> None:
        self.files = files
        self.label = label

    def size(self) -> int:
        """Total bytes (the progress bar's unit)."""
        return sum(f.stat().st_size for f in self.files)

    def content_hash(self) -> str:
        h = hashlib.sha256(b"files\0")
        total = 0
        for path in self.files:
            fh = hashlib.sha256()
            try:
                with open(path, "rb") as f:
                    while block := f.read(READ_BLOCK_BYTES):
                        fh.update(block)
                        total += len(block)
            except OSError as exc:
                raise InputError(
                    f"{self.label}: cannot read {str(path)!r}: {exc.strerror}."
                ) from None
            h.update(fh.digest())
        if total == 0:
            raise InputError(
                f"{self.label}: the corpus is empty ({len(self.files)} file(s), 0 bytes): "
                "point it at a file with text in it."
            )
        return h.hexdigest()

    def documents(self, progress: OnProgress = lambda n: None) -> Iterator[Iterator[str]]:
        """Each file as an iterator of decoded text blocks; `progress` gets bytes read."""
        for path in self.files:
            yield _read_utf8_blocks(path, progress)

    def text_bytes(self) -> int:
        """The corpus's size in bytes of UTF-8 text."""
        return self.size()

    def sample_texts(self, limit: int) -> Iterator[str]:
        """About `limit` bytes of the text, spread evenly over the files as one stream: blocks
        of at most `SAMPLE_BLOCK_BYTES` taken at equal strides, each cut to whole lines (a cut
        at a newline byte is always between two UTF-8 characters)."""
        sizes = [f.stat().st_size for f in self.files]
        total = sum(sizes)
        want = min(limit, total)
        # At least SAMPLE_BLOCKS blocks (of 4 KiB or more), so that a small sample spreads too.
        n_blocks = max(1, -(-want // SAMPLE_BLOCK_BYTES), min(SAMPLE_BLOCKS, want // 4096))
        length = max(1, want // n_blocks)
        stride, start = total / n_blocks, 0
        for path, size in zip(self.files, sizes, strict=True):
            with open(path, "rb") as f:
                for i in range(n_blocks):
                    offset = int(i * stride) - start
                    if 0 <= offset < size:
                        f.seek(offset)
                        block = f.read(min(length, size - offset))
                        yield _whole_lines(block, offset == 0, offset + len(block) == size, path)
            start += size


class DatasetSource:
    """One text column of a Hugging Face `datasets.Dataset`, one document per row.

    Args:
        dataset: the `datasets.Dataset`.
        column: the text column (checked to exist and hold strings).
        label: how messages name the source.
    """

    def __init__(self, dataset: Any, column: str, label: str) -> None:
        _check_text_column(dataset.features, column, label)
        self.dataset = dataset.select_columns([column])
        self.column = column
        self.label = label
        self._text_bytes: int | None = None

    def size(self) -> int:
        """Number of rows (the progress bar's unit)."""
        return self.dataset.num_rows

    def _texts(self) -> Iterator[list[str]]:
        for batch in self.dataset.iter(batch_size=1000):
            yield [t or "" for t in batch[self.column]]

    def content_hash(self) -> str:
        h = hashlib.sha256(b"dataset\0")
        total = 0
        for texts in self._texts():
            for text in texts:
                data = text.encode("utf-8", "surrogatepass")
                h.update(len(data).to_bytes(8, "little"))
                h.update(data)
                total += len(data)
        if total == 0:
            raise InputError(
                f"{self.label}: the corpus is empty ({self.dataset.num_rows} rows, no text in "
                f"column {self.column!r})."
            )
        self._text_bytes = total
        return h.hexdigest()

    def documents(self, progress: OnProgress = lambda n: None) -> Iterator[Iterator[str]]:
        """Each row as a one-block iterator; `progress` gets rows read."""
        for texts in self._texts():
            for text in texts:
                yield iter((text,))
            progress(len(texts))

    def text_bytes(self) -> int:
        """The column's size in bytes of UTF-8 text (counted by `content_hash`)."""
        if self._text_bytes is None:
            self.content_hash()
        return self._text_bytes

    def sample_texts(self, limit: int) -> Iterator[str]:
        """About `limit` bytes of the text: every k-th row, spread evenly over the dataset."""
        every = max(1, -(-self.text_bytes() // max(1, limit)))
        for start in range(0, self.dataset.num_rows, 1000 * every):
            rows = self.dataset[start : start + 1000 * every : every][self.column]
            yield from (text or "" for text in rows)


class StreamSource:
    """One text column of a `datasets.IterableDataset` (`data.streaming`), one document per
    row, read as it arrives: nothing is downloaded or converted ahead of tokenizing.

    Args:
        dataset: the `datasets.IterableDataset`.
        column: the text column, checked to exist and hold strings (from the features, else,
            when the stream does not know them, from its first row).
        label: how messages name the source.
        origin: what identifies the stream's text for the cache (see `_open_stream`): the
            sha256 of its local files' bytes, or a hub dataset's name and commit; with the split.
        rows: its number of rows, if known (the progress bar's total).
    """

    def __init__(
        self, dataset: Any, column: str, label: str, origin: str, rows: int | None = None
    ) -> None:
        features = dataset.features
        if features is None:
            features = _first_row_features(dataset, label)
        _check_text_column(features, column, label)
        self.dataset = dataset.select_columns([column])
        self.column = column
        self.label = label
        self.origin = origin
        self.rows = rows if rows is not None else _known_rows(dataset)

    def size(self) -> int | None:
        """Number of rows (the progress bar's unit), None if the stream does not say."""
        return self.rows

    def content_hash(self) -> str:
        """The cache key of the stream's text, found without reading a row (a stream is read
        once, as it is tokenized): `origin` and the text column. Local files count by their
        bytes, so a changed file is a new key; a hub dataset by the commit its revision named
        when it was opened, so a new commit upstream is a new key, and an interrupted prepare
        never continues on other rows than it began with."""
        return hashlib.sha256(f"stream\0{self.origin}\0{self.column}".encode()).hexdigest()

    def documents(
        self, progress: OnProgress = lambda n: None, skip: int = 0
    ) -> Iterator[Iterator[str]]:
        """Each row from row `skip` on as a one-block iterator; `progress` gets rows read.

        The rows before `skip` are read past (`IterableDataset.skip`: a stream cannot seek),
        not tokenized again."""
        dataset = self.dataset.skip(skip) if skip else self.dataset
        batches = dataset.iter(batch_size=1000)
        row = skip
        while True:
            try:
                batch = next(batches, None)
            except _dataset_errors() as exc:  # a malformed line or a lost connection, say
                raise InputError(f"cannot read {self.label} at row {row}: {exc}") from None
            if batch is None:
                return
            texts = batch[self.column]
            for text in texts:
                if text is not None and not isinstance(text, str):
                    raise InputError(
                        f"{self.label}: row {row} of column {self.column!r} holds "
                        f"{type(text).__name__}, not text; set data.text_column to a string "
                        "column."
                    )
                yield iter((text or "",))
                row += 1
            progress(len(texts))

    def text_bytes(self) -> None:
        """None: a stream's size is not known before it is read."""
        return None

    def sample_texts(self, limit: int) -> Iterator[str]:
        """The rows' texts from the start of the stream until about `limit` bytes of UTF-8
        text (the last row whole). A stream cannot be sampled evenly without reading all of
        it: this is its beginning, as good as any part of a shuffled dataset, and not of one
        sorted by topic or date."""
        n = 0
        for document in self.documents():
            if n >= limit:
                return
            for text in document:
                n += len(text.encode("utf-8", "surrogatepass"))
                yield text


Source = FileSource | DatasetSource | StreamSource


def _check_text_column(features: Any, column: str, label: str) -> None:
    """Refuse a text column that `features` (column name -> `datasets` feature) lacks, or one
    whose feature is not a string."""
    if column not in features:
        raise InputError(
            f"{label}: data.text_column ({column!r}) is not a column of the dataset; its "
            f"columns are: {', '.join(features)}. Set data.text_column to one of them."
        )
    dtype = getattr(features[column], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise InputError(
            f"{label}: column {column!r} holds {dtype or features[column]}, not text; set "
            "data.text_column to a string column."
        )


def _first_row_features(dataset: Any, label: str) -> dict[str, Any]:
    """Features read off a stream's first row, for a stream that does not know its own: a
    string (or a null) counts as a string column, anything else by its type's name."""
    import datasets

    try:
        row = next(iter(dataset.take(1)), None)
    except _dataset_errors() as exc:
        raise InputError(f"cannot read {label}: {exc}") from None
    if row is None:
        raise InputError(f"{label}: the corpus is empty (the stream has no rows).")
    string = datasets.Value("string")
    return {
        name: string if value is None or isinstance(value, str) else type(value).__name__
        for name, value in row.items()
    }


def _known_rows(dataset: Any) -> int | None:
    """A stream's number of rows when its metadata records it (many hub datasets), else None."""
    splits = dataset.info.splits
    split = splits.get(str(dataset.split)) if splits and dataset.split is not None else None
    return split.num_examples if split is not None and split.num_examples else None


def _dataset_errors() -> tuple[type[BaseException], ...]:
    """What `datasets` raises for input it cannot load or read (pyarrow's parse errors are
    ValueErrors)."""
    import datasets

    return (
        FileNotFoundError,
        ConnectionError,
        ValueError,
        datasets.exceptions.DatasetGenerationError,
    )


def _whole_lines(block: bytes, at_start: bool, at_end: bool, path: Path) -> str:
    """A block read from the middle of a file, cut to the lines it holds whole."""
    if not at_start:
        block = block[block.find(b"\n") + 1 :] if b"\n" in block else b""
    if not at_end:
        block = block[: block.rfind(b"\n") + 1]
    try:
        return block.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{str(path)!r} is not UTF-8 text ({exc.reason}): save it as UTF-8."
        ) from None


def _read_utf8_blocks(path: Path, progress: Callable[[int], None]) -> Iterator[str]:
    """Decode a file as strict UTF-8 block by block, naming the file and byte offset on error."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0  # bytes given to the decoder so far
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BLOCK_BYTES)
            held = len(decoder.getstate()[0])  # bytes of a split character held from before
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                # exc.object is the held bytes followed by this block.
                at = offset - held + exc.start
                f.seek(at)
                bad = f.read(4)
                raise InputError(
                    f"{str(path)!r} is not UTF-8 text: the bytes at offset {at} "
                    f"({bad.hex(' ')}...) do not decode "
                    f"({exc.reason}). "
                    "Convert the file to UTF-8, e.g. `iconv -f latin1 -t utf-8`."
                ) from None
            progress(len(block))
            offset += len(block)
            if text:
                yield text
            if not block:
                return


def skipped_rows_note(
    split: str, what: tuple[str, str], where: Sequence[str], why: str, fix: str
) -> str | None:
    """The warning for a split's rows (prompts, pairs, conversations) that are left out, naming
    the first few by file and line, the rule they broke and what to do; None when none were.

    Args:
        split: "train" or "validation".
        what: the rows' noun, singular and plural ("prompt", "prompts").
        where: each skipped row's place ("data/p.jsonl line 3").
        why: the rule, naming the setting ("longer than model.context_length (64 tokens)").
        fix: what to do.
    """
    if not where:
        return None
    rows = counted(len(where), *what)
    return f"{rows} of the {split} split skipped as {why}: {first_few(where)}. {fix}"


def rows_to_train(n_rows: int, val_fraction: float, label: str, what: str) -> int:
    """How many of `n_rows` rows (conversations, pairs, prompts) train when the last
    `data.val_fraction` of them are held out for validation, as rows without a `data.val_path`
    are split.

    Raises:
        InputError: too few rows to leave some on both sides; `label` names the source and
            `what` the rows ("conversations").
    """
    n_train = int(n_rows * (1 - val_fraction))
    if n_train < 1 or n_train == n_rows:
        raise InputError(
            f"{label} holds {counted(n_rows, what.removesuffix('s'), what)}: too few to hold "
            "out the last data.val_fraction "
            f"({val_fraction}) for validation. Add {what}, change data.val_fraction, or give "
            "data.val_path."
        )
    return n_train


def resolve_files(spec: str, key: str, suffix: str = ".txt", what: str = "text") -> list[Path]:
    """A file, a folder (every file ending in `suffix` below it) or a glob, as a sorted list
    of files; `what` names their content in messages ("text", "JSONL"). A relative `data/...`
    missing here is the file shipped with llmcli (`shipped_data`)."""
    p = shipped_data(spec)
    if _GLOB_CHARS.search(spec) and not p.exists():
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        if not files:
            raise InputError(f"{key} ({spec!r}) is a glob that matches no files: check it.")
        return files
    if p.is_dir():
        files = sorted(f for f in p.rglob(f"*{suffix}") if f.is_file())
        if not files:
            raise InputError(
                f"{key} ({spec!r}) is a folder with no {suffix} files below it: put the "
                f"{what} in {suffix} files, or give a file or a glob."
            )
        return files
    refuse_special_file(p, f"{key} ({spec!r})", "a file or folder")
    if not p.is_file():
        raise InputError(
            f"{key} ({spec!r}) does not exist (relative paths start from {os.getcwd()!r}): "
            f"give a {what} file, a folder of {suffix} files or a glob."
        )
    return [p]


def _load_dataset(spec: str, split: str, key: str, cache_dir: Path, streaming: bool = False) -> Any:
    """A `datasets.Dataset` from a save_to_disk folder, local json/jsonl/csv/parquet files
    (a file, a folder or a glob) or a hub name (network; `name@revision` pins a branch, tag or
    commit). `streaming`: a `datasets.IterableDataset` instead, except from a save_to_disk
    folder, which `datasets` loads only whole (memory-mapped)."""
    import datasets  # slow to import, and not needed for plain text: import here

    p = Path(spec).expanduser()
    label = f"{key} ({spec!r})"
    refuse_special_file(p, label, "a file or folder")
    builder = _DATASET_FILE_BUILDERS.get(p.suffix.lower())
    cache = str(cache_dir / "datasets")
    try:
        if p.is_dir() and any((p / m).exists() for m in _SAVE_TO_DISK_MARKERS):
            loaded = datasets.load_from_disk(str(p))
        elif builder and (p.is_file() or _GLOB_CHARS.search(spec)):
            files = [str(f) for f in resolve_files(spec, key)]
            loaded = datasets.load_dataset(
                builder, data_files=files, cache_dir=cache, streaming=streaming
            )
        elif p.exists():
            loaded = datasets.load_dataset(str(p), cache_dir=cache, streaming=streaming)
        else:  # a hub name: downloads go to the datasets library's own cache, shared
            name, _, revision = spec.partition("@")
            loaded = datasets.load_dataset(name, revision=revision or None, streaming=streaming)
    except _dataset_errors() as exc:
        raise InputError(f"cannot load {label}: {exc}") from None
    if isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in loaded:
            raise InputError(
                f"{label} has no split {split!r}; its splits are: {', '.join(loaded)}. Set "
                "data.split (or data.val_split) to one of them."
            )
        loaded = loaded[split]
    return loaded


def open_sources(data_cfg: DataConfig, cache_dir: Path) -> tuple[Source, Source | None]:
    """The training source and the separate validation source (None: split off the tail)."""
    if data_cfg.path is not None:
        if data_cfg.val_split is not None:
            raise InputError(
                f"data.val_split ({data_cfg.val_split!r}) applies to data.dataset only; with "
                "data.path give a separate validation file as data.val_path."
            )
        train = FileSource(
            resolve_files(data_cfg.path, "data.path"), f"data.path ({data_cfg.path!r})"
        )
        val = None
        if data_cfg.val_path is not None:
            val = FileSource(
                resolve_files(data_cfg.val_path, "data.val_path"),
                f"data.val_path ({data_cfg.val_path!r})",
            )
        return train, val
    if data_cfg.dataset is None:
        raise InputError("data: give data.path or data.dataset; both are empty.")
    train = _open_dataset(data_cfg, data_cfg.dataset, data_cfg.split, "data.dataset", cache_dir)
    if data_cfg.val_path is None and data_cfg.val_split is None:
        return train, None
    # The validation text is split `val_split` (default: data.split) of `val_path` (default:
    # the training dataset).
    spec = data_cfg.val_path or data_cfg.dataset
    split = data_cfg.val_split or data_cfg.split
    key = "data.val_path" if data_cfg.val_path else "data.dataset"
    return train, _open_dataset(data_cfg, spec, split, key, cache_dir)


def _open_dataset(
    data_cfg: DataConfig, spec: str, split: str, key: str, cache_dir: Path
) -> DatasetSource | StreamSource:
    """Split `split` of the dataset `spec` (named by config key `key`) as a source: a stream
    when `data.streaming` is set."""
    if data_cfg.streaming:
        return _open_stream(spec, split, data_cfg.text_column, key, cache_dir)
    ds = _load_dataset(spec, split, key, cache_dir)
    return DatasetSource(ds, data_cfg.text_column, f"{key} ({spec!r}, split {split!r})")


def _open_stream(spec: str, split: str, column: str, key: str, cache_dir: Path) -> StreamSource:
    """A dataset read as a stream (`data.streaming`): hub names and local json/jsonl/csv/parquet
    files through `datasets`' streaming mode; a save_to_disk folder, which `datasets` cannot
    stream, through `Dataset.to_iterable_dataset` (it is memory-mapped, not downloaded, so
    streaming it gains only the resumable token cache).

    A hub name is pinned to the commit its revision (`name@revision`, default the main branch)
    names now, so that every row read, this time and when an interrupted prepare continues,
    comes from that commit."""
    import datasets

    label = f"{key} ({spec!r}, split {split!r})"
    files = _local_files(spec, key)
    if files is None:
        name, _, revision = spec.partition("@")
        if not re.fullmatch(r"[0-9a-f]{40}", revision):
            revision = _hub_commit(name, revision or None, label)
        spec, origin = f"{name}@{revision}", f"hub\0{name}\0{revision}"
    else:  # the files' bytes: hashing them reads the disk, not the stream
        origin = "files\0" + FileSource(files, label).content_hash()
    ds = _load_dataset(spec, split, key, cache_dir, streaming=True)
    rows = None
    if isinstance(ds, datasets.Dataset):
        rows, ds = ds.num_rows, ds.to_iterable_dataset()
    return StreamSource(ds, column, label, f"{origin}\0{split}", rows)


def _local_files(spec: str, key: str) -> list[Path] | None:
    """The files a local dataset `spec` reads (the file, the glob's files, every file below the
    folder but hidden ones, which `datasets` skips too: a clone's `.git/`), sorted; None when
    `spec` names no local path (a hub name)."""
    p = Path(spec).expanduser()
    if p.is_dir():
        files = (f for f in p.rglob("*") if f.is_file())
        return sorted(
            f for f in files if not any(s.startswith(".") for s in f.relative_to(p).parts)
        )
    if p.exists() or _GLOB_CHARS.search(spec):
        return resolve_files(spec, key)
    return None


def _hub_commit(name: str, revision: str | None, label: str) -> str:
    """The commit that `revision` (None: the main branch) of the hub dataset `name` names now."""
    from huggingface_hub import HfApi  # installed with datasets

    try:
        info = HfApi().dataset_info(name, revision=revision)
    except Exception as exc:  # network and hub errors share no base class but Exception
        raise InputError(
            f"cannot look up {label} on the Hugging Face Hub ({type(exc).__name__}: {exc}): "
            "check the name and the network, or give local files."
        ) from None
    return info.sha or revision or "main"
