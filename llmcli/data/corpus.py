"""Reading corpora: local text files, folders and globs, or Hugging Face `datasets` sources.

A source yields documents (a file, a dataset row) as iterators of text blocks, so that a corpus
larger than memory is read piece by piece; `content_hash` identifies its text for the token
cache. `datasets` is imported only when a dataset source is used: it is slow to import and an
installation may lack it.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmcli.errors import InputError
from llmcli.fileio import refuse_special_file

if TYPE_CHECKING:
    from llmcli.config import DataConfig

READ_BLOCK_BYTES = 16 << 20  # bytes read from a file at a time
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


class DatasetSource:
    """One text column of a Hugging Face `datasets.Dataset`, one document per row.

    Args:
        dataset: the `datasets.Dataset`.
        column: the text column (checked to exist and hold strings).
        label: how messages name the source.
    """

    def __init__(self, dataset: Any, column: str, label: str) -> None:
        if column not in dataset.column_names:
            raise InputError(
                f"{label}: data.text_column ({column!r}) is not a column of the dataset; its "
                f"columns are: {', '.join(dataset.column_names)}. Set data.text_column to one "
                "of them."
            )
        dtype = getattr(dataset.features[column], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise InputError(
                f"{label}: column {column!r} holds {dtype or dataset.features[column]}, not "
                "text; set data.text_column to a string column."
            )
        self.dataset = dataset.select_columns([column])
        self.column = column
        self.label = label

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
        return h.hexdigest()

    def documents(self, progress: OnProgress = lambda n: None) -> Iterator[Iterator[str]]:
        """Each row as a one-block iterator; `progress` gets rows read."""
        for texts in self._texts():
            for text in texts:
                yield iter((text,))
            progress(len(texts))


Source = FileSource | DatasetSource


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


def _resolve_files(spec: str, key: str) -> list[Path]:
    """A file, a folder (every `.txt` below it) or a glob, as a sorted list of files."""
    p = Path(spec).expanduser()
    if _GLOB_CHARS.search(spec) and not p.exists():
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        if not files:
            raise InputError(f"{key} ({spec!r}) is a glob that matches no files: check it.")
        return files
    if p.is_dir():
        files = sorted(f for f in p.rglob("*.txt") if f.is_file())
        if not files:
            raise InputError(
                f"{key} ({spec!r}) is a folder with no .txt files below it: put the text in "
                ".txt files, or give a file or a glob."
            )
        return files
    refuse_special_file(p, f"{key} ({spec!r})", "a file or folder")
    if not p.is_file():
        raise InputError(
            f"{key} ({spec!r}) does not exist (relative paths start from {os.getcwd()!r}): "
            "give a text file, a folder of .txt files or a glob."
        )
    return [p]


def _load_dataset(spec: str, split: str, key: str, cache_dir: Path) -> Any:
    """A `datasets.Dataset` from a save_to_disk folder, local json/jsonl/csv/parquet files
    (a file, a folder or a glob) or a hub name (network)."""
    import datasets  # slow to import, and not needed for plain text: import here

    p = Path(spec).expanduser()
    label = f"{key} ({spec!r})"
    refuse_special_file(p, label, "a file or folder")
    errors = (
        FileNotFoundError,
        ConnectionError,
        ValueError,
        datasets.exceptions.DatasetGenerationError,
    )
    builder = _DATASET_FILE_BUILDERS.get(p.suffix.lower())
    try:
        if p.is_dir() and any((p / m).exists() for m in _SAVE_TO_DISK_MARKERS):
            loaded = datasets.load_from_disk(str(p))
        elif builder and (p.is_file() or _GLOB_CHARS.search(spec)):
            files = [str(f) for f in _resolve_files(spec, key)]
            loaded = datasets.load_dataset(
                builder, data_files=files, cache_dir=str(cache_dir / "datasets")
            )
        elif p.exists():
            loaded = datasets.load_dataset(str(p), cache_dir=str(cache_dir / "datasets"))
        else:  # a hub name: downloads go to the datasets library's own cache, shared
            loaded = datasets.load_dataset(spec)
    except errors as exc:
        raise InputError(f"cannot load {label}: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
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
            _resolve_files(data_cfg.path, "data.path"), f"data.path ({data_cfg.path!r})"
        )
        val = None
        if data_cfg.val_path is not None:
            val = FileSource(
                _resolve_files(data_cfg.val_path, "data.val_path"),
                f"data.val_path ({data_cfg.val_path!r})",
            )
        return train, val
    if data_cfg.dataset is None:
        raise InputError("data: give data.path or data.dataset; both are empty.")
    ds = _load_dataset(data_cfg.dataset, data_cfg.split, "data.dataset", cache_dir)
    train = DatasetSource(
        ds, data_cfg.text_column, f"data.dataset ({data_cfg.dataset!r}, split {data_cfg.split!r})"
    )
    if data_cfg.val_path is None and data_cfg.val_split is None:
        return train, None
    # The validation text is split `val_split` (default: data.split) of `val_path` (default:
    # the training dataset).
    spec = data_cfg.val_path or data_cfg.dataset
    split = data_cfg.val_split or data_cfg.split
    key = "data.val_path" if data_cfg.val_path else "data.dataset"
    val_ds = _load_dataset(spec, split, key, cache_dir)
    return train, DatasetSource(val_ds, data_cfg.text_column, f"{key} ({spec!r}, split {split!r})")


# --- Tokenizing into the cache -------------------------------------------------------------
