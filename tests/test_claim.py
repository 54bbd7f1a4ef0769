"""One writer at a time: a claim is refused (or waited for) while another holds it, names the
holder, and ends with its process, however that process ends."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from llmcli.claim import (
    LOCK_FILE,
    Busy,
    claimed,
    claimed_folder,
    missing_folders,
    note_path,
)
from llmcli.errors import InputError

ROOT = Path(__file__).resolve().parents[1]


def test_a_second_writer_is_refused_naming_the_first(tmp_path: Path) -> None:
    lock = tmp_path / "run" / LOCK_FILE
    with claimed(lock, "the run 'run'"):
        assert note_path(lock).is_file()
        with pytest.raises(Busy) as refused, claimed(lock, "the run 'run'", fix="Go elsewhere."):
            pytest.fail("a second claim was granted")
    message = str(refused.value)
    assert message.startswith(f"the run 'run' is being written by process {os.getpid()} (`")
    assert Path(sys.argv[0]).name in message and message.endswith("). Go elsewhere.")
    assert not note_path(lock).exists()  # the holder's note goes with its claim
    with claimed(lock, "the run 'run'"):  # and the next writer gets it
        pass


def test_a_killed_holder_never_blocks_the_next_writer(tmp_path: Path) -> None:
    lock = tmp_path / LOCK_FILE
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from llmcli.claim import claimed\n"
        "with claimed(Path(sys.argv[1]), 'it'):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code, str(lock)], env=env, timeout=60)
    assert done.returncode == -signal.SIGKILL
    assert note_path(lock).is_file()  # a killed holder leaves its note, and no lock
    with claimed(lock, "it"):
        assert f'"pid": {os.getpid()}' in note_path(lock).read_text()


def test_a_waiting_writer_says_whom_it_waits_for_and_goes_on_when_it_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lock, events = tmp_path / "entry.lock", []
    held, waiting = threading.Event(), threading.Event()

    def first() -> None:
        with claimed(lock, "the entry"):
            held.set()
            waiting.wait(timeout=60)
            events.append("first ends")

    class Waiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            waiting.set()

    thread = threading.Thread(target=first)
    thread.start()
    held.wait(timeout=60)
    handler = Waiting()
    logging.getLogger("llmcli.claim").addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="llmcli.claim"), claimed(lock, "x", wait=True):
            events.append("second starts")
    finally:
        logging.getLogger("llmcli.claim").removeHandler(handler)
    thread.join()
    assert events == ["first ends", "second starts"]
    assert f"waiting for process {os.getpid()} (`" in caplog.text
    assert "which is writing x" in caplog.text


def test_a_folder_made_for_a_claim_is_removed_when_nothing_was_written(tmp_path: Path) -> None:
    folder = tmp_path / "a" / "b"
    made = missing_folders(folder)
    assert made == [folder, tmp_path / "a"]
    folder.mkdir(parents=True)
    with claimed_folder(folder, made, "it", ""):
        assert (folder / LOCK_FILE).is_file()
    assert not (tmp_path / "a").exists()

    # A folder that was there keeps what it had, and gets no lock file from a writer that
    # wrote nothing; one that was written keeps its lock file (for the next writer).
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with claimed_folder(tmp_path / "mine", [], "it", ""):
        pass
    assert sorted(os.listdir(tmp_path / "mine")) == ["notes.txt"]
    with claimed_folder(tmp_path / "mine", [], "it", ""):
        (tmp_path / "mine" / "model.safetensors").write_bytes(b"")
    assert sorted(os.listdir(tmp_path / "mine")) == [LOCK_FILE, "model.safetensors", "notes.txt"]


def test_a_claim_where_nothing_can_be_written_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match=r"^cannot write the run \(.*\): choose a folder"):
        with claimed(tmp_path / "file" / "run" / LOCK_FILE, "the run"):
            pass
