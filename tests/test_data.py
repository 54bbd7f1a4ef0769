"""Data: sources, the token cache, splits, bad input, and the batch sampler (against nanoGPT's
`get_batch` formula)."""

import ast
import csv
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmcli.cache import default_cache_dir
from llmcli.config import DataConfig
from llmcli.data import corpus, tokenizer_cache
from llmcli.data import token_cache as D
from llmcli.data import tokenizer as tokenizer_module
from llmcli.data.batches import BatchSampler
from llmcli.data.prepared import TokenData
from llmcli.data.tokenizer import BPETokenizer, CharTokenizer
from llmcli.data.tokens import prepare_data
from llmcli.errors import ConfigError, InputError

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data" / "shakespeare.txt"


@pytest.fixture(scope="module")
def text() -> str:
    return CORPUS.read_text(encoding="utf-8")[:20_000]


@pytest.fixture(scope="module")
def bpe(text: str) -> BPETokenizer:
    return BPETokenizer.train([text], vocab_size=400)


def char_ids(text: str, chars: list[str] | None = None) -> list[int]:
    """The char encoding: ids are ranks in sorted(set(text)) (plus the newline)."""
    chars = chars or sorted(set(text) | {"\n"})
    stoi = {c: i for i, c in enumerate(chars)}
    return [stoi[c] for c in text]


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8", newline="")
    return path


def prep(tmp_path: Path, context_length: int = 8, **cfg) -> TokenData:
    return prepare_data(DataConfig(**cfg), context_length, cache_dir=tmp_path / "cache")


# --- plain text sources and the cache ------------------------------------------------------


def test_char_file_matches_reference_split(tmp_path: Path, text: str) -> None:
    path = write(tmp_path / "corpus.txt", text)
    d = prep(tmp_path, path=str(path), val_fraction=0.1)
    ref = np.array(char_ids(text))
    n_train = int(len(ref) * 0.9)  # nanoGPT: the first 90% train, the rest validation
    assert isinstance(d.train, np.memmap) and isinstance(d.val, np.memmap)
    assert d.train.dtype == np.uint16 and d.val.dtype == np.uint16
    np.testing.assert_array_equal(d.train, ref[:n_train])
    np.testing.assert_array_equal(d.val, ref[n_train:])
    assert d.tokenizer.decode(np.asarray(d.train[:300]).tolist()) == text[:300]
    assert len(d.source_hash) == 64


def test_cache_is_reused_and_invalidated(tmp_path: Path, text: str, monkeypatch) -> None:
    calls = []
    real = D._tokenize_to_file
    monkeypatch.setattr(D, "_tokenize_to_file", lambda *a: calls.append(1) or real(*a))
    path = write(tmp_path / "corpus.txt", text)
    first = prep(tmp_path, path=str(path))
    second = prep(tmp_path, path=str(path))
    assert len(calls) == 1
    assert second.cache_files == first.cache_files and second.source_hash == first.source_hash
    write(path, text.replace("the", "THE"))  # same size, new content
    third = prep(tmp_path, path=str(path))
    assert len(calls) == 2 and third.source_hash != first.source_hash
    np.testing.assert_array_equal(
        np.concatenate([third.train, third.val]), char_ids(text.replace("the", "THE"))
    )
    # Same text, other tokenizer: a new cache entry too.
    prep(tmp_path, path=str(path), tokenizer="bpe", vocab_size=300)
    assert len(calls) == 3


def test_two_prepares_of_one_entry_at_once_tokenize_it_once(
    tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "corpus.txt", text)
    alone = prep(tmp_path / "alone", path=str(path), tokenizer="bpe", vocab_size=300)
    trainings, tokenizings, inside, waited = [], [], threading.Event(), threading.Event()
    real_train, real_tokenize = tokenizer_cache.train_tokenizer, D._tokenize_to_file

    def tokenize(*args):  # the first prepare, holding the entry's claim, waits for the second
        tokenizings.append(threading.current_thread().name)
        inside.set()
        assert waited.wait(timeout=60), "the second prepare did not wait for the entry"
        return real_tokenize(*args)

    class Waited(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "which is writing the token cache entry" in record.getMessage():
                waited.set()

    monkeypatch.setattr(
        tokenizer_cache, "train_tokenizer", lambda *a: trainings.append(1) or real_train(*a)
    )
    monkeypatch.setattr(D, "_tokenize_to_file", tokenize)
    results = {}

    def run(name: str) -> None:
        results[name] = prep(tmp_path, path=str(path), tokenizer="bpe", vocab_size=300)

    first = threading.Thread(target=run, args=("first",), name="first")
    first.start()
    assert inside.wait(timeout=60)
    handler = Waited()
    claim_log = logging.getLogger("llmcli.claim")
    claim_log.addHandler(handler)
    claim_log.setLevel(logging.INFO)
    try:
        run("second")
    finally:
        claim_log.removeHandler(handler)
        claim_log.setLevel(logging.NOTSET)
        first.join()
    assert trainings == [1] and tokenizings == ["first"]  # the second read the first's
    assert results["first"].cache_files == results["second"].cache_files
    (file,) = results["second"].cache_files
    assert file.read_bytes() == alone.cache_files[0].read_bytes()
    assert sorted(p.name for p in file.parent.iterdir() if p.suffix != ".lock") == sorted(
        [file.name, file.with_suffix(".json").name]
    )


def test_given_tokenizer_is_used_as_is(tmp_path: Path) -> None:
    path = write(tmp_path / "c.txt", "abc" * 30)
    tok = CharTokenizer("abcdefgh\n")
    d = prepare_data(DataConfig(path=str(path)), 4, tokenizer=tok, cache_dir=tmp_path / "c")
    assert d.tokenizer is tok
    np.testing.assert_array_equal(
        np.concatenate([d.train, d.val]), char_ids(path.read_text(), tok.chars)
    )


def test_folder_and_glob_join_documents_with_newline(tmp_path: Path) -> None:
    a = "first document, " * 5
    b = "second one. " * 5
    c = "third, in a sub-folder " * 5
    write(tmp_path / "docs" / "b.txt", b)
    write(tmp_path / "docs" / "a.txt", a)
    write(tmp_path / "docs" / "sub" / "c.txt", c)
    write(tmp_path / "docs" / "notes.md", "not text input")
    d = prep(tmp_path, path=str(tmp_path / "docs"))  # every .txt below, sorted by path
    np.testing.assert_array_equal(np.concatenate([d.train, d.val]), char_ids("\n".join([a, b, c])))
    g = prep(tmp_path, path=str(tmp_path / "docs" / "*.txt"))  # a glob: not recursive here
    np.testing.assert_array_equal(np.concatenate([g.train, g.val]), char_ids("\n".join([a, b])))


def test_bpe_documents_joined_with_eot_and_pieces_encode_like_the_whole(
    tmp_path: Path, text: str, bpe: BPETokenizer, monkeypatch
) -> None:
    # Tiny pieces, batches and read blocks: many cuts, blocks ending inside multi-byte
    # characters; the tokens must still be those of encoding each document whole.
    monkeypatch.setattr(D, "PIECE_CHARS", 50)
    monkeypatch.setattr(D, "BATCH_CHARS", 300)
    monkeypatch.setattr(corpus, "READ_BLOCK_BYTES", 37)
    doc1 = text[:6000] + "\n  indented\n\n\n   \nline with trailing spaces   \nx y\n"
    doc2 = "Unicode: héllo wörld 🎉 日本語\n" * 20 + "no-spaces-" * 60
    write(tmp_path / "d" / "1.txt", doc1)
    write(tmp_path / "d" / "2.txt", doc2)
    bpe_path = tmp_path / "tok.json"
    bpe.save(bpe_path)
    d = prep(tmp_path, path=str(tmp_path / "d"), tokenizer=str(bpe_path))
    ref = bpe.encode(doc1) + [bpe.eot_id] + bpe.encode(doc2)
    np.testing.assert_array_equal(np.concatenate([d.train, d.val]), ref)


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.lists(st.text(alphabet=" \nab.é", max_size=40), max_size=8), size=st.integers(1, 12)
)
def test_pieces_put_back_together_give_the_text(blocks: list[str], size: int) -> None:
    pieces = list(D._pieces(iter(blocks), size))
    assert "".join(pieces) == "".join(blocks)
    assert all(pieces)


def test_uint32_when_the_vocabulary_does_not_fit_uint16(tmp_path: Path) -> None:
    chars = [chr(0x20000 + i) for i in range(70_000)]  # 70,000 distinct characters
    body = "".join(chars) + "\n" + "".join(reversed(chars))
    path = write(tmp_path / "wide.txt", body)
    d = prep(tmp_path, path=str(path))
    assert d.tokenizer.vocab_size == 70_002 and d.train.dtype == np.uint32
    np.testing.assert_array_equal(np.concatenate([d.train, d.val]), char_ids(body))


def test_separate_validation_file(tmp_path: Path) -> None:
    train_text = "the quick brown fox jumps over the lazy dog. " * 10
    val_text = "QUICK! " * 10  # characters absent from the training file
    d = prep(
        tmp_path,
        path=str(write(tmp_path / "t.txt", train_text)),
        val_path=str(write(tmp_path / "v.txt", val_text)),
    )
    chars = sorted(set(train_text + val_text + "\n"))
    np.testing.assert_array_equal(d.train, char_ids(train_text, chars))
    np.testing.assert_array_equal(d.val, char_ids(val_text, chars))
    assert len(d.cache_files) == 2


def test_default_cache_dir(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMCLI_CACHE", str(tmp_path / "a"))
    assert default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("LLMCLI_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "llmcli"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "llmcli"
    # data.cache_dir is used when no cache_dir argument is given.
    path = write(tmp_path / "c.txt", "hello world " * 10)
    d = prepare_data(DataConfig(path=str(path), cache_dir=str(tmp_path / "cfg")), 4)
    assert d.cache_files[0].parent == tmp_path / "cfg" / "tokens"


def test_datasets_is_imported_lazily() -> None:
    # `datasets` is slow to import and may be absent: no module-level import of it (checked on
    # the source, as other tests import it into this process).
    for module in (D, tokenizer_module):
        tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
        for node in tree.body:
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.split(".")[0] == "datasets" for n in names), module.__name__


# --- bad input ------------------------------------------------------------------------------


def test_missing_path_empty_folder_and_glob(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"data.path \('.*nope.txt'\) does not exist"):
        prep(tmp_path, path=str(tmp_path / "nope.txt"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(InputError, match="no .txt files"):
        prep(tmp_path, path=str(tmp_path / "empty_dir"))
    with pytest.raises(InputError, match="matches no files"):
        prep(tmp_path, path=str(tmp_path / "*.none"))
    with pytest.raises(InputError, match=r"data.val_path \('.*v.txt'\) does not exist"):
        prep(
            tmp_path,
            path=str(write(tmp_path / "t.txt", "x" * 50)),
            val_path=str(tmp_path / "v.txt"),
        )


def test_empty_corpus(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="empty"):
        prep(tmp_path, path=str(write(tmp_path / "empty.txt", "")))


def test_too_short_for_context_names_split_size_and_need(tmp_path: Path) -> None:
    path = write(tmp_path / "short.txt", "x" * 100)  # 90 train + 10 validation tokens
    with pytest.raises(InputError, match=r"train split has 90 tokens.*\(128\).*at least 129"):
        prep(tmp_path, context_length=128, path=str(path))
    with pytest.raises(
        InputError,
        match=r"validation split has 10 tokens.*\(16\).*at least 17"
        r".*val_fraction",
    ):
        prep(tmp_path, context_length=16, path=str(path))
    d = prep(tmp_path, context_length=9, path=str(path))  # 10 >= 9 + 1: just enough
    assert (len(d.train), len(d.val)) == (90, 10)


def test_non_utf8_names_file_and_offset(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(corpus, "READ_BLOCK_BYTES", 7)  # the offset must survive block boundaries
    good = "é" * 50  # 100 bytes of two-byte characters
    path = write(tmp_path / "latin1.txt", good.encode() + b"caf\xe9 au lait")
    with pytest.raises(InputError, match=r"latin1.txt.*not UTF-8.*offset 103 \(e9 20 61 75"):
        prep(tmp_path, path=str(path))
    cut = write(tmp_path / "cut.txt", b"ok\xe2\x82")  # a character cut off at the end
    with pytest.raises(InputError, match=r"cut.txt.*offset 2 "):
        prep(tmp_path, path=str(cut))


def test_bpe_vocab_too_small(tmp_path: Path) -> None:
    path = write(tmp_path / "c.txt", "hello world " * 10)
    with pytest.raises(InputError, match=r"data.vocab_size \(200\) is too small"):
        prep(tmp_path, path=str(path), tokenizer="bpe", vocab_size=200)


def test_val_split_needs_a_dataset(tmp_path: Path) -> None:
    path = write(tmp_path / "c.txt", "hello world " * 10)
    with pytest.raises(InputError, match="val_split.*data.dataset only"):
        prep(tmp_path, path=str(path), val_split="validation")


def test_a_named_pipe_or_a_device_as_data_is_named_and_refused_unopened(tmp_path: Path) -> None:
    # Opening a named pipe waits for a writer, and none comes: only a refusal that stats it
    # first returns at all.
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    text = write(tmp_path / "t.txt", "x" * 50)
    pipe = r"is a named pipe, not a file or folder: llmcli reads only regular files"
    with pytest.raises(InputError, match=r"data.path \('.*corpus.txt'\) " + pipe):
        prep(tmp_path, path=str(fifo))
    with pytest.raises(InputError, match=r"data.val_path \('.*corpus.txt'\) " + pipe):
        prep(tmp_path, path=str(text), val_path=str(fifo))
    with pytest.raises(InputError, match=r"data.dataset \('.*corpus.txt'\) " + pipe):
        prep(tmp_path, path=None, dataset=str(fifo))
    with pytest.raises(InputError, match=r"tokenizer file '.*corpus.txt' is a named pipe"):
        prep(tmp_path, path=str(text), tokenizer=str(fifo))
    if Path("/dev/null").exists():
        with pytest.raises(InputError, match=r"'/dev/null'\) is a character device, not a file"):
            prep(tmp_path, path="/dev/null")


def test_train_on_a_named_pipe_exits_2_naming_it_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    config = write(tmp_path / "c.yaml", f"data: {{path: {str(fifo)!r}}}\n")
    out = subprocess.run(
        [sys.executable, "-m", "llmcli", "train", str(config), "--out", str(tmp_path / "run")],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,  # a read that waits for a writer fails the test here instead of hanging
    )
    assert out.returncode == 2, out.stderr
    assert f"data.path ({str(fifo)!r}) is a named pipe, not a file or folder" in out.stderr
    assert "Traceback" not in out.stderr


# --- datasets sources (local files only) -----------------------------------------------------

ROWS = [f"row {i}: {'to be or not to be ' * (i % 3 + 1)}" for i in range(40)]


def _write_rows(tmp_path: Path, fmt: str, rows: list[str], column: str = "text") -> Path:
    records = [{column: r, "id": i} for i, r in enumerate(rows)]
    path = tmp_path / f"rows.{fmt}"
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    elif fmt == "json":
        path.write_text(json.dumps(records), encoding="utf-8")
    elif fmt == "csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=[column, "id"])
            writer.writeheader()
            writer.writerows(records)
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv", "parquet"])
def test_dataset_files_rows_joined_with_newline(tmp_path: Path, fmt: str) -> None:
    path = _write_rows(tmp_path, fmt, ROWS)
    d = prep(tmp_path, path=None, dataset=str(path))
    np.testing.assert_array_equal(np.concatenate([d.train, d.val]), char_ids("\n".join(ROWS)))


def test_dataset_rows_joined_with_eot_for_bpe(tmp_path: Path, bpe: BPETokenizer) -> None:
    path = _write_rows(tmp_path, "jsonl", ROWS)
    d = prepare_data(
        DataConfig(path=None, dataset=str(path)), 8, tokenizer=bpe, cache_dir=tmp_path / "cache"
    )
    ref = []
    for i, row in enumerate(ROWS):
        ref += ([bpe.eot_id] if i else []) + bpe.encode(row)
    np.testing.assert_array_equal(np.concatenate([d.train, d.val]), ref)


def test_dataset_save_to_disk_with_splits(tmp_path: Path) -> None:
    import datasets

    val_rows = ["held-out text, never trained on? " * 2] * 5
    ds = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"content": ROWS}),
            "validation": datasets.Dataset.from_dict({"content": val_rows}),
        }
    )
    ds.save_to_disk(str(tmp_path / "saved"))
    d = prep(
        tmp_path,
        path=None,
        dataset=str(tmp_path / "saved"),
        text_column="content",
        val_split="validation",
    )
    chars = sorted(set("".join(ROWS + val_rows)) | {"\n"})
    np.testing.assert_array_equal(d.train, char_ids("\n".join(ROWS), chars))
    np.testing.assert_array_equal(d.val, char_ids("\n".join(val_rows), chars))
    with pytest.raises(InputError, match="no split 'test'; its splits are: train, validation"):
        prep(
            tmp_path,
            path=None,
            dataset=str(tmp_path / "saved"),
            text_column="content",
            split="test",
        )
    # A single saved Dataset (no splits).
    ds["train"].save_to_disk(str(tmp_path / "one"))
    one = prep(tmp_path, path=None, dataset=str(tmp_path / "one"), text_column="content")
    np.testing.assert_array_equal(np.concatenate([one.train, one.val]), char_ids("\n".join(ROWS)))


def test_dataset_separate_validation_file(tmp_path: Path) -> None:
    train = _write_rows(tmp_path / "t", "jsonl", ROWS)
    val = _write_rows(tmp_path / "v", "jsonl", ROWS[:5])
    d = prep(tmp_path, path=None, dataset=str(train), val_path=str(val))
    np.testing.assert_array_equal(d.train, char_ids("\n".join(ROWS)))
    np.testing.assert_array_equal(
        d.val, char_ids("\n".join(ROWS[:5]), sorted(set("\n".join(ROWS)) | {"\n"}))
    )


def test_dataset_missing_or_non_text_column(tmp_path: Path) -> None:
    path = _write_rows(tmp_path, "jsonl", ROWS, column="content")
    with pytest.raises(InputError, match=r"text_column \('text'\).*columns are: content, id"):
        prep(tmp_path, path=None, dataset=str(path))
    with pytest.raises(InputError, match="column 'id' holds int64, not text"):
        prep(tmp_path, path=None, dataset=str(path), text_column="id")


def test_dataset_empty_text(tmp_path: Path) -> None:
    path = _write_rows(tmp_path, "jsonl", ["", ""])
    with pytest.raises(InputError, match="empty"):
        prep(tmp_path, path=None, dataset=str(path))


# --- streaming datasets (data.streaming) ----------------------------------------------------

STREAM_ROWS = [f"row {i}: {'to be or not to be ' * (i % 4)}" for i in range(95)]


def _cache_file(cache: Path) -> Path:
    (path,) = (cache / "tokens").glob("*.bin")
    return path


@pytest.mark.parametrize(
    ("fmt", "tokenizer", "piece_rows", "val_file"),
    [
        ("jsonl", "char", 7, True),
        ("parquet", "char", 19, False),  # 95 rows: 5 whole pieces, then an empty end
        ("jsonl", "bpe", 10, False),
        ("parquet", "bpe", 1000, True),  # one piece
    ],
)
def test_streaming_gives_the_tokens_of_the_whole_dataset(
    tmp_path: Path, bpe: BPETokenizer, monkeypatch, fmt, tokenizer, piece_rows, val_file
) -> None:
    monkeypatch.setattr(D, "STREAM_PIECE_ROWS", piece_rows)
    path = _write_rows(tmp_path / "train", fmt, STREAM_ROWS)
    val = str(_write_rows(tmp_path / "val", fmt, STREAM_ROWS[:30:3])) if val_file else None
    tok = bpe if tokenizer == "bpe" else None

    def run(streaming: bool, cache: str) -> TokenData:
        cfg = DataConfig(path=None, dataset=str(path), val_path=val, streaming=streaming)
        return prepare_data(cfg, 8, tokenizer=tok, cache_dir=tmp_path / cache)

    whole, streamed = run(False, "whole"), run(True, "streamed")
    np.testing.assert_array_equal(streamed.train, whole.train)
    np.testing.assert_array_equal(streamed.val, whole.val)
    if tokenizer == "char":
        assert streamed.tokenizer.to_json() == whole.tokenizer.to_json()
    assert not list((tmp_path / "streamed" / "tokens").glob("*.parts"))  # pieces removed
    assert streamed.source_hash != whole.source_hash  # the files' bytes, not the rows' text
    monkeypatch.setattr(D, "_tokenize_stream", lambda *a: pytest.fail("tokenized again"))
    assert run(True, "streamed").cache_files == streamed.cache_files  # the finished cache


def _count_stream_reads(monkeypatch, stop_after: int | None = None) -> dict:
    """Count the rows `StreamSource.documents` yields and the `skip` it gets; raise
    KeyboardInterrupt (a Ctrl-C) when `stop_after` rows have been read."""
    seen = {"rows": 0, "skips": []}
    real = corpus.StreamSource.documents
    real = getattr(real, "__wrapped__", real)  # not an earlier call's counter

    def documents(self, progress=lambda n: None, skip=0):
        seen["skips"].append(skip)
        for document in real(self, progress, skip):
            if seen["rows"] == stop_after:
                raise KeyboardInterrupt
            seen["rows"] += 1
            yield document

    documents.__wrapped__ = real
    monkeypatch.setattr(corpus.StreamSource, "documents", documents)
    return seen


def test_interrupted_stream_continues_where_it_stopped(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(D, "STREAM_PIECE_ROWS", 10)
    path = _write_rows(tmp_path, "jsonl", STREAM_ROWS)
    tok = CharTokenizer.train(STREAM_ROWS)  # given: no training pass reads the stream
    cfg = DataConfig(path=None, dataset=str(path), streaming=True)
    prepare_data(cfg, 8, tokenizer=tok, cache_dir=tmp_path / "clean")
    clean = _cache_file(tmp_path / "clean").read_bytes()

    cache = tmp_path / "cache"
    _count_stream_reads(monkeypatch, stop_after=37)  # in the 4th piece
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, 8, tokenizer=tok, cache_dir=cache)
    (parts,) = (cache / "tokens").glob("*.parts")
    assert sorted(p.name for p in parts.iterdir()) == [
        "000000.bin",
        "000001.bin",
        "000002.bin",
        "progress.json",
    ]
    record = json.loads((parts / "progress.json").read_text())
    assert record["rows"] == 30 and len(record["pieces"]) == 3
    assert not list((cache / "tokens").glob("*.bin"))

    seen = _count_stream_reads(monkeypatch)
    d = prepare_data(cfg, 8, tokenizer=tok, cache_dir=cache)
    assert seen == {"rows": len(STREAM_ROWS) - 30, "skips": [30]}
    assert _cache_file(cache).read_bytes() == clean
    assert not parts.exists()
    np.testing.assert_array_equal(
        np.concatenate([d.train, d.val]), tok.encode("\n".join(STREAM_ROWS))
    )


def test_damaged_stream_pieces_start_the_stream_over(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(D, "STREAM_PIECE_ROWS", 10)
    path = _write_rows(tmp_path, "jsonl", STREAM_ROWS)
    tok = CharTokenizer.train(STREAM_ROWS)
    cfg = DataConfig(path=None, dataset=str(path), streaming=True)
    _count_stream_reads(monkeypatch, stop_after=25)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, 8, tokenizer=tok, cache_dir=tmp_path / "cache")
    (parts,) = (tmp_path / "cache" / "tokens").glob("*.parts")
    piece = parts / "000001.bin"
    piece.write_bytes(piece.read_bytes()[:-2])  # a piece that lost its end
    seen = _count_stream_reads(monkeypatch)
    d = prepare_data(cfg, 8, tokenizer=tok, cache_dir=tmp_path / "cache")
    assert seen["skips"] == [0] and seen["rows"] == len(STREAM_ROWS)
    np.testing.assert_array_equal(
        np.concatenate([d.train, d.val]), tok.encode("\n".join(STREAM_ROWS))
    )


def test_stream_sample_is_its_first_rows(tmp_path: Path) -> None:
    path = _write_rows(tmp_path, "jsonl", ["ab", "cdé", "fg", "hi"])
    source, _ = corpus.open_sources(
        DataConfig(path=None, dataset=str(path), streaming=True), tmp_path / "cache"
    )
    assert isinstance(source, corpus.StreamSource)
    assert source.size() is None and source.text_bytes() is None
    assert list(source.sample_texts(6)) == ["ab", "cdé"]  # 2 + 4 bytes of UTF-8
    assert list(source.sample_texts(7)) == ["ab", "cdé", "fg"]  # the last row whole
    assert [list(d) for d in source.documents(skip=3)] == [["hi"]]


def test_stream_empty_text(tmp_path: Path) -> None:
    path = _write_rows(tmp_path, "jsonl", ["", ""])
    with pytest.raises(InputError, match=r"empty \(2 rows, no text in column 'text'\)"):
        prep(tmp_path, path=None, dataset=str(path), streaming=True)


def test_stream_of_a_hub_name_is_keyed_by_its_commit_without_reading(
    tmp_path: Path, monkeypatch
) -> None:
    import datasets
    import huggingface_hub

    reads, loads, commit = [], [], {"sha": "a" * 40}

    def rows():
        for text in ["one row", "another row"]:
            reads.append(text)
            yield {"text": text, "n": 1}

    features = datasets.Features({"text": datasets.Value("string"), "n": datasets.Value("int64")})

    def load_dataset(name, revision=None, streaming=False):
        loads.append((name, revision, streaming))
        stream = datasets.IterableDataset.from_generator(rows, features=features)
        return datasets.IterableDatasetDict({"train": stream})

    class Info:
        def __init__(self, sha):
            self.sha = sha

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(
        huggingface_hub.HfApi, "dataset_info", lambda self, name, revision=None: Info(commit["sha"])
    )
    cfg = DataConfig(path=None, dataset="someone/corpus@v1", streaming=True)
    first, _ = corpus.open_sources(cfg, tmp_path)
    key = first.content_hash()
    assert loads == [("someone/corpus", "a" * 40, True)]  # pinned to the commit v1 names now
    assert reads == []  # the key needs no row
    commit["sha"] = "b" * 40  # a new commit upstream: a new key
    assert corpus.open_sources(cfg, tmp_path)[0].content_hash() != key
    other_column = DataConfig(
        path=None, dataset="someone/corpus@v1", streaming=True, text_column="n"
    )
    with pytest.raises(InputError, match="column 'n' holds int64, not text"):
        corpus.open_sources(other_column, tmp_path)
    pinned = DataConfig(path=None, dataset=f"someone/corpus@{'c' * 40}", streaming=True)
    corpus.open_sources(pinned, tmp_path)  # a full commit is used as is, not looked up
    assert loads[-1] == ("someone/corpus", "c" * 40, True)


def test_stream_without_features_checks_the_first_row(tmp_path: Path) -> None:
    import datasets

    def rows():
        yield from ({"text": f"row {i}", "n": i} for i in range(3))

    stream = datasets.IterableDataset.from_generator(rows)
    assert stream.features is None
    source = corpus.StreamSource(stream, "text", "a stream", "test")
    assert [list(d) for d in source.documents()] == [["row 0"], ["row 1"], ["row 2"]]
    with pytest.raises(InputError, match="column 'n' holds int, not text"):
        corpus.StreamSource(stream, "n", "a stream", "test")
    with pytest.raises(InputError, match=r"text_column \('body'\).*columns are: text, n"):
        corpus.StreamSource(stream, "body", "a stream", "test")


def test_streaming_missing_text_column_exits_2_naming_it(tmp_path: Path, capsys) -> None:
    from llmcli.cli import main

    path = _write_rows(tmp_path, "jsonl", STREAM_ROWS, column="content")
    cfg = write(
        tmp_path / "c.yaml", f"data: {{path: null, dataset: {str(path)!r}, streaming: true}}\n"
    )
    with pytest.raises(SystemExit) as exit_:
        main(["prepare-data", str(cfg), "--cache-dir", str(tmp_path / "cache")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"data.dataset ({str(path)!r}, split 'train'): data.text_column ('text') is not" in err
    assert "its columns are: content, id" in err and "Traceback" not in err


STREAM_WRAPPER = """\
import sys

from llmcli.data import token_cache

token_cache.STREAM_PIECE_ROWS = int(sys.argv[1])  # small pieces: many moments to be killed in
from llmcli.cli import main

main(sys.argv[2:])
"""


def _pieces_done(cache: Path) -> int:
    return len(list((cache / "tokens").glob("*.parts/[0-9]*.bin")))


@pytest.mark.slow
def test_prepare_data_killed_at_random_moments_ends_with_the_same_file(tmp_path: Path) -> None:
    words = "to be or not that is the question whether tis nobler in mind".split()
    rows = [
        " ".join(words[(i * 7 + k) % len(words)] for k in range(i % 6 + 1)) for i in range(40_000)
    ]
    data = write(tmp_path / "rows.jsonl", "".join(json.dumps({"text": r}) + "\n" for r in rows))
    config = write(
        tmp_path / "c.yaml", f"data: {{path: null, dataset: {str(data)!r}, streaming: true}}\n"
    )
    cache = tmp_path / "cache"
    command = [
        sys.executable,
        str(write(tmp_path / "prepare.py", STREAM_WRAPPER)),
        "200",  # rows a piece: 200 pieces
        "prepare-data",
        str(config),
        "--cache-dir",
        str(cache),
        "--set",
        "model.context_length=16",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    rng = random.Random(0)
    for target in sorted(rng.sample(range(2, 190), 3)):  # pieces done when killed
        proc = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 60
        while proc.poll() is None and _pieces_done(cache) < target and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.02))  # anywhere in a piece, or in writing its record
        proc.kill()
        assert proc.wait() == -signal.SIGKILL, "finished before it was killed"
    done = _pieces_done(cache)
    final = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert final.returncode == 0, final.stderr
    assert (
        f"after row {done * 200}" in final.stderr or f"after row {(done - 1) * 200}" in final.stderr
    )
    streamed = _cache_file(cache).read_bytes()
    assert not list((cache / "tokens").glob("*.parts")) and not list(cache.rglob(".*.tmp-*"))

    prepare_data(DataConfig(path=None, dataset=str(data)), 16, cache_dir=tmp_path / "clean")
    assert streamed == _cache_file(tmp_path / "clean").read_bytes()


# --- the batch sampler ----------------------------------------------------------------------


def nanogpt_get_batch(data: np.ndarray, batch_size: int, block_size: int, g: torch.Generator):
    """nanoGPT's train.py get_batch, with an explicit generator."""
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=g)
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack(
        [torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix]
    )
    return x, y


@pytest.fixture
def tokens(tmp_path: Path) -> np.memmap:
    rng = np.random.default_rng(0)
    path = tmp_path / "tokens.bin"
    rng.integers(0, 50_000, size=10_000, dtype=np.uint16).tofile(path)
    return np.memmap(path, dtype=np.uint16, mode="r")


def test_sampler_matches_nanogpt_get_batch(tokens: np.memmap) -> None:
    sampler = BatchSampler(tokens, batch_size=6, context_length=32, seed=123)
    g = torch.Generator().manual_seed(123)
    for _ in range(5):
        x, y = sampler.next()
        rx, ry = nanogpt_get_batch(np.asarray(tokens), 6, 32, g)
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (6, 32)
        torch.testing.assert_close(x, rx, rtol=0, atol=0)
        torch.testing.assert_close(y, ry, rtol=0, atol=0)
        torch.testing.assert_close(x[:, 1:], y[:, :-1], rtol=0, atol=0)


def test_sampler_reads_memmap_views_and_offsets_like_arrays(tokens: np.memmap) -> None:
    path = tokens.filename
    cases = {
        "view": tokens[1234:8000],
        "offset": np.memmap(path, dtype=np.uint16, mode="r", offset=2 * 777, shape=(5000,)),
        "view of offset": np.memmap(path, dtype=np.uint16, mode="r", offset=2 * 5000)[3:4000],
        "strided (indexed directly)": tokens[::3],
    }
    for name, view in cases.items():
        sampler = BatchSampler(view, 5, 24, seed=3)
        assert (sampler.reader._fd is None) == name.startswith("strided"), name
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            x, y = sampler.next()
            rx, ry = nanogpt_get_batch(np.array(view), 5, 24, g)
            assert torch.equal(x, rx) and torch.equal(y, ry), name
        sampler.close()


def test_sampler_same_seed_same_stream_other_seed_other_stream(tokens: np.memmap) -> None:
    a = BatchSampler(tokens, 4, 16, seed=1)
    b = BatchSampler(np.array(tokens), 4, 16, seed=1)  # in-memory array: same batches
    c = BatchSampler(tokens, 4, 16, seed=2)
    for _ in range(3):
        xa, ya = a.next()
        xb, yb = b.next()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, c.next()[0])


def test_sampler_ranks_draw_different_reproducible_streams(tokens: np.memmap) -> None:
    r0 = [BatchSampler(tokens, 4, 16, seed=5, rank=0, world_size=2).next()[0] for _ in range(2)]
    r1 = [BatchSampler(tokens, 4, 16, seed=5, rank=1, world_size=2).next()[0] for _ in range(2)]
    assert torch.equal(r0[0], r0[1]) and torch.equal(r1[0], r1[1])
    assert not torch.equal(r0[0], r1[0])
    with pytest.raises(ValueError, match="rank"):
        BatchSampler(tokens, 4, 16, seed=5, rank=2, world_size=2)


def test_sampler_state_round_trip_continues_the_stream(tokens: np.memmap, tmp_path) -> None:
    sampler = BatchSampler(tokens, 4, 16, seed=9)
    for _ in range(3):
        sampler.next()
    torch.save(sampler.state_dict(), tmp_path / "state.pt")
    expected = [sampler.next() for _ in range(4)]
    resumed = BatchSampler(tokens, 4, 16, seed=0)  # the seed is overridden by the state
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert resumed.batches == 3
    for ex, ey in expected:
        x, y = resumed.next()
        assert torch.equal(x, ex) and torch.equal(y, ey)
    with pytest.raises(InputError, match="rng_state"):
        resumed.load_state_dict({"batches": 1})


def test_sampler_needs_context_plus_one_tokens() -> None:
    with pytest.raises(InputError, match="at least 17"):
        BatchSampler(np.zeros(16, dtype=np.uint16), 2, 16, seed=0)
    x, y = BatchSampler(np.arange(17, dtype=np.uint16), 2, 16, seed=0).next()
    assert torch.equal(x[0], torch.arange(16)) and torch.equal(y[0], torch.arange(1, 17))


def test_sampler_on_prepared_data(tmp_path: Path, text: str) -> None:
    d = prep(tmp_path, context_length=32, path=str(write(tmp_path / "c.txt", text)))
    x, y = BatchSampler(d.val, 8, 32, seed=0).next()
    ref = np.asarray(d.val)
    for row_x, row_y in zip(x.numpy(), y.numpy(), strict=True):
        start = next(i for i in range(len(ref) - 32) if (ref[i : i + 32] == row_x).all())
        np.testing.assert_array_equal(row_y, ref[start + 1 : start + 33])


def test_cli_prepare_data(tmp_path: Path, text: str, capsys) -> None:
    from llmcli.cli import main

    corpus = write(tmp_path / "c.txt", text)
    cfg = write(tmp_path / "cfg.yaml", f"data: {{path: {str(corpus)!r}}}\n")
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "prepare-data",
                str(cfg),
                "--cache-dir",
                str(tmp_path / "cache"),
                "--set",
                "model.context_length=16",
            ]
        )
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    n_train = int(len(text) * 0.9)
    assert f"{n_train:,} train + {len(text) - n_train:,} validation tokens (uint16)" in out
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "prepare-data",
                str(cfg),
                "--cache-dir",
                str(tmp_path / "cache"),
                "--set",
                f"data.path={tmp_path / 'missing.txt'}",
            ]
        )
    assert exit_.value.code == 2
    assert "error: data.path" in capsys.readouterr().err


# --- The tokenizer's sample ----------------------------------------------------------------


def _numbered_lines(n: int) -> str:
    return "".join(f"line {i:06d}: the quick brown fox jumps over the lazy dog\n" for i in range(n))


def test_a_file_sample_is_whole_lines_spread_evenly_over_the_files(tmp_path: Path) -> None:
    lines = _numbered_lines(60_000).splitlines(keepends=True)  # about 3.4 MB
    a = write(tmp_path / "a.txt", "".join(lines[:20_000]))
    b = write(tmp_path / "b.txt", "".join(lines[20_000:]))
    source = corpus.FileSource([a, b], "test")
    limit = 1 << 20
    sample = list(source.sample_texts(limit))
    joined = "".join(sample)
    assert 0.9 * limit <= len(joined.encode()) <= limit
    taken = [line for text in sample for line in text.splitlines(keepends=True)]
    assert set(taken) <= set(lines)  # whole lines only, none cut
    numbers = sorted(int(line[5:11]) for line in taken)
    # Spread evenly: every tenth of the corpus is in it, from both files.
    assert {n * 10 // 60_000 for n in numbers} == set(range(10))
    assert numbers[0] == 0 and numbers[-1] > 55_000


def test_a_dataset_sample_is_every_kth_row(tmp_path: Path) -> None:
    rows = [f"row {i} " + "x" * 90 for i in range(2_000)]  # about 100 bytes each
    path = _write_rows(tmp_path, "jsonl", rows)
    cfg = DataConfig(path=None, dataset=str(path))
    source, _ = corpus.open_sources(cfg, tmp_path / "cache")
    sample = list(source.sample_texts(20_000))
    assert sample == rows[:: -(-source.text_bytes() // 20_000)]
    assert 15_000 <= sum(map(len, sample)) <= 20_000


def test_bpe_trains_on_the_sample_which_keys_its_cache(tmp_path: Path, monkeypatch) -> None:
    text = _numbered_lines(40_000)  # about 2.3 MB
    path = write(tmp_path / "c.txt", text)
    fed: list[int] = []
    train = BPETokenizer.train.__func__

    def counting(cls, texts, vocab_size):
        texts = list(texts)
        fed.append(sum(len(t.encode()) for t in texts))
        return train(cls, texts, vocab_size)

    monkeypatch.setattr(BPETokenizer, "train", classmethod(counting))
    cfg = DataConfig(path=str(path), tokenizer="bpe", vocab_size=300, tokenizer_sample="256KB")
    data = prepare_data(cfg, 8, cache_dir=tmp_path / "cache")
    assert 0.9 * 2**18 <= fed[0] <= 2**18
    training = data.tokenizer_training
    assert training["trained_on_bytes"] == fed[0] and training["corpus_bytes"] == len(text)
    assert training["sample"] == "256KB" and training["vocab_size"] == data.tokenizer.vocab_size
    # The same sample again: the cached tokenizer, with its record; another size trains again.
    again = prepare_data(cfg, 8, cache_dir=tmp_path / "cache")
    assert len(fed) == 1 and again.tokenizer_training == training
    cfg.tokenizer_sample = "512KB"
    prepare_data(cfg, 8, cache_dir=tmp_path / "cache")
    assert len(fed) == 2 and fed[1] > 1.8 * fed[0]
    # Smaller than the sample: the whole corpus, keyed as before samples existed.
    cfg.tokenizer_sample = "64MB"
    whole = prepare_data(cfg, 8, cache_dir=tmp_path / "cache")
    assert fed[2] == len(text) and whole.tokenizer_training["sample"] is None


def test_tokenizer_sample_and_streaming_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.tokenizer_sample \('lots'\) must be a positive"):
        DataConfig(tokenizer_sample="lots").validate()
    with pytest.raises(ConfigError, match=r"data.streaming \(True\) needs data.dataset"):
        DataConfig(streaming=True).validate()
    assert DataConfig(tokenizer_sample="1.5MB").tokenizer_sample_bytes == 1_572_864
    assert DataConfig(tokenizer_sample=None).tokenizer_sample_bytes is None


def test_prepare_data_reports_throughput_and_memory_then_a_cache_hit(tmp_path, capsys) -> None:
    from llmcli.cli import main

    path = write(tmp_path / "c.txt", _numbered_lines(2_000))
    args = ["prepare-data", "tiny", "--set", f"data.path={path}", "--cache-dir", str(tmp_path)]
    for expected in (
        r"prepared in [\d.]+ s: [\d.]+ MiB/s of text, [\d,]+ tokens/s, peak memory",
        r"read from the cache in [\d.]+ s, peak memory [\d.]+ MiB",
    ):
        with pytest.raises(SystemExit) as exc:
            main(args)
        out = capsys.readouterr().out
        assert exc.value.code == 0 and re.search(expected, out), out
