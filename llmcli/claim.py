"""One writer at a time: an exclusive claim on a run directory, a token cache entry or an SAE
folder.

A process that writes one of these holds an operating-system lock on a file there for as long
as it writes (`filelock`: `flock` on Unix, `LockFileEx` on Windows), and beside it a note of who
holds it (pid, host, command, start) that another process's message names. The operating system
drops the lock when its process ends, however it ends (SIGKILL, a power loss), so a dead holder
never blocks the next writer: the note it may leave behind is read only while the lock is held.

A second writer of a run directory or an SAE folder is refused at once (`claimed`); a second
prepare of one token cache entry waits for the first and then reads its result
(`claimed(..., wait=True)`). Readers (`sample`, `eval`, `info`, `serve`, looking inside) take
no claim: every file is replaced atomically (`llmcli.fileio`), so they read the last whole save.
Under torchrun only rank 0 writes, and it alone claims; an elastic restart starts once the old
group has exited, and with it the old claim.

The lock file stays in place after a release (removing it would let a waiter lock a file that
is no longer the one at that path); the note is removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from llmcli.errors import InputError, describe_os_error
from llmcli.fileio import JSONFileError, atomic_write_json, read_json

log = logging.getLogger(__name__)

LOCK_FILE = ".llmcli.lock"  # a claimed folder's lock; its holder's note is LOCK_FILE + ".json"


class Busy(InputError):
    """Another live process holds the claim."""


def note_path(lock: Path) -> Path:
    """Where the holder of `lock` writes who it is."""
    return lock.with_name(lock.name + ".json")


def holder(lock: Path) -> str:
    """Who holds `lock`, in words, from its note ("another process" when it has none yet)."""
    try:
        note = read_json(note_path(lock))
        pid, host, command, started = (note[k] for k in ("pid", "host", "command", "started"))
    except (JSONFileError, KeyError, TypeError):
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    where = "" if host == socket.gethostname() else f" on {host}"
    return f"process {pid}{where} (`{command}`, since {since})"


@contextlib.contextmanager
def claimed(lock: Path, what: str, fix: str = "", wait: bool = False) -> Iterator[None]:
    """Hold the lock file `lock` (created with its folder if missing) while the block runs.

    Args:
        lock: the lock file.
        what: what the claim is on, for the messages ("'checkpoints/tiny'").
        fix: what to do instead, for a refused writer's message.
        wait: wait for the holder to finish (saying so once) instead of refusing.

    Raises:
        Busy: another process holds `lock` and `wait` is False; the message names it.
    """
    from filelock import FileLock, Timeout

    file_lock = FileLock(lock, timeout=0)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        try:
            file_lock.acquire()
        except Timeout:
            if not wait:
                raise Busy(f"{what} is being written by {holder(lock)}. {fix}".rstrip()) from None
            log.info("waiting for %s, which is writing %s", holder(lock), what)
            file_lock.acquire(timeout=-1)
    except OSError as exc:
        raise InputError(
            f"cannot write {what} ({describe_os_error(exc)}): choose a folder you can write to."
        ) from None
    try:
        _write_note(lock)
        yield
    finally:
        with contextlib.suppress(OSError):
            note_path(lock).unlink()
        file_lock.release()


def missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, deepest first: what making it
    makes (for `claimed_folder` to remove again)."""
    return [p for p in (folder, *folder.parents) if not p.exists()]


@contextlib.contextmanager
def claimed_folder(folder: Path, made: list[Path], what: str, fix: str) -> Iterator[None]:
    """`claimed` on the folder's own lock file (`LOCK_FILE`), refusing a second writer.

    A writer that leaves the folder as it found it (a start refused for bad input) leaves no
    lock file either, and the folders in `made` (`missing_folders`, taken before the caller
    made `folder`) are removed again.
    """
    before = set(os.listdir(folder))
    try:
        with claimed(folder / LOCK_FILE, what, fix):
            yield
    finally:
        if LOCK_FILE not in before and set(os.listdir(folder)) == before | {LOCK_FILE}:
            with contextlib.suppress(OSError):
                (folder / LOCK_FILE).unlink()
                for empty in made:
                    empty.rmdir()


def _write_note(lock: Path) -> None:
    command = " ".join([Path(sys.argv[0]).name, *map(shlex.quote, sys.argv[1:])])
    note = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": command[:200],
        "started": time.time(),
    }
    with contextlib.suppress(OSError):  # the note is for messages: the lock is what protects
        atomic_write_json(note_path(lock), note)
