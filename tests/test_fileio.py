"""llmcli.fileio: reading JSON files, whatever is wrong with them, and the newest of some files.
(Atomic writes: tests/test_run_directory.py; under crashes, tests/test_crash.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmcli.fileio import (
    TMP_MARK,
    JSONFileError,
    near_path,
    newest,
    read_json,
    remove_stale_temp_files,
)


def test_read_json_reads_any_json_value(tmp_path: Path) -> None:
    for value in ({"a": [1, 2.5, None]}, [1, "x"], "text", 3):
        path = tmp_path / "v.json"
        path.write_text(json.dumps(value), encoding="utf-8")
        assert read_json(path) == value


@pytest.mark.parametrize(
    ("content", "problem", "cause"),
    [
        (
            b'{"a": 1',
            "it is not valid JSON (Expecting ',' delimiter at line 1, column 8)",
            ValueError,
        ),
        (b"\xff\xfe{}", "it is not UTF-8 text (bad byte at offset 0)", UnicodeDecodeError),
        (
            b"[" * 100_000 + b"]" * 100_000,
            "it nests lists or objects too deeply to read",
            RecursionError,
        ),
    ],
)
def test_read_json_says_what_is_wrong_with_a_damaged_file(
    tmp_path: Path, content: bytes, problem: str, cause: type
) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(JSONFileError) as info:
        read_json(path)
    assert str(info.value) == problem
    assert isinstance(info.value.cause, cause) and not info.value.missing
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still do


def test_read_json_of_a_missing_file_or_a_folder(tmp_path: Path) -> None:
    with pytest.raises(JSONFileError) as info:
        read_json(tmp_path / "missing.json")
    assert info.value.missing and str(info.value).startswith("it cannot be read (")
    with pytest.raises(JSONFileError) as info:
        read_json(tmp_path)
    assert not info.value.missing and str(info.value).startswith("it cannot be read (")


def test_newest_is_the_file_written_last_and_ties_go_by_path(tmp_path: Path) -> None:
    paths = [tmp_path / name for name in ("b.txt", "a.txt", "c.txt")]
    for i, path in enumerate(paths):
        path.write_text("x")
        os.utime(path, ns=(10**18, 10**18 + i * 1000))
    assert newest(paths) == paths[2]
    os.utime(paths[2], ns=(10**18, 10**18))  # c ties with b: the later path wins
    os.utime(paths[0], ns=(10**18, 10**18))
    assert newest(paths) == paths[1]  # a.txt is the newest alone
    os.utime(paths[1], ns=(10**18, 10**18 - 1))
    assert newest(paths) == paths[2]
    assert newest(reversed(paths)) == paths[2]


def test_newest_leaves_out_folders_and_missing_paths(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    assert newest([tmp_path / "folder", tmp_path / "missing"]) is None
    assert newest([]) is None
    (tmp_path / "f").write_text("x")
    assert newest([tmp_path / "folder", tmp_path / "f"]) == tmp_path / "f"


def test_only_the_temporary_files_of_processes_that_are_gone_are_removed(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            "gone": f".state.pt{TMP_MARK}{gone.stdout.strip()}",  # killed mid-write, say
            "live": f".state.pt{TMP_MARK}{live.pid}",  # another process, writing now
            "mine": f".meta.json{TMP_MARK}{os.getpid()}",
            "no pid": f".loss.png{TMP_MARK}x",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"part")
        (tmp_path / "state.pt").write_bytes(b"whole")
        remove_stale_temp_files(tmp_path)
    finally:
        live.kill()
        live.wait()
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == sorted([names["live"], names["mine"], "state.pt"])


def test_near_path_mends_each_missing_part_by_its_closest_neighbour(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "tiny").mkdir(parents=True)
    assert near_path(tmp_path / "checkpoint" / "tiny") == tmp_path / "checkpoints" / "tiny"
    assert near_path(tmp_path / "checkpoints" / "tiyn") == tmp_path / "checkpoints" / "tiny"
    assert near_path(tmp_path / "checkpoints" / "tiny") is None  # not missing
    assert near_path(tmp_path / "elsewhere" / "tiny") is None  # nothing close
