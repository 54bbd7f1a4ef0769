"""Files: atomic writes that survive a crash, and reading a user's text file with a clear error.

Every file llmcli writes (run files, the token cache, tokenizers, attention dumps, pictures,
exports) goes through `atomic_path`: the data is written to a temporary name in the same folder,
flushed to disk (fsync) and renamed into place (`os.replace`), so a crash or a full disk at any
instant leaves either the old file or the new one, never a half-written one.

A file the user names is read only if it is a regular file (`refuse_special_file`): a named pipe,
a socket or a device is refused before it is opened, since opening a named pipe waits until
another program writes to it.

JSON files (a run's `meta.json`, the token cache's records, an SAE's `cfg.json`, result files)
are read by `read_json`, which turns every way a file can fail to be JSON into one error whose
message says what is wrong in a few words; each reader decides what a bad file means to it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from llmcli.errors import CheckpointError, InputError, describe_os_error

TMP_MARK = ".tmp-"  # in the name of every temporary file (see `remove_stale_temp_files`)
TMP_GLOB = f".*{TMP_MARK}*"  # what every temporary file's name matches


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; not every platform can open a directory.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_and_sync(path: Path, data: bytes) -> None:
    """Write `data` to a new file at `path` and flush it to disk."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _sync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` to write the new content to, in any way.

    When the block succeeds the temporary file is flushed to disk and renamed to `path`. On any
    failure inside the block or after it (for example `OSError(ENOSPC)`, or Ctrl-C) the
    temporary file is removed, the previous file at `path` is left untouched, and the error
    propagates.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
    try:
        yield tmp
        _sync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` atomically (see `atomic_path`)."""
    with atomic_path(path) as tmp:
        _write_and_sync(tmp, data)


def atomic_write_text(path: str | Path, text: str) -> None:
    """`atomic_write_bytes` for UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """`atomic_write_bytes` for a JSON document (indented, sorted keys, trailing newline)."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_figure(path: str | Path, figure: Any, **savefig: Any) -> None:
    """Save a matplotlib figure to `path` as a PNG, atomically (`atomic_write_bytes`); `savefig`
    are matplotlib's options (`dpi`, `bbox_inches`)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", **savefig)
    atomic_write_bytes(path, buffer.getvalue())


def append_json_line(fh: Any, path: Path, record: dict[str, Any]) -> int:
    """Append `record` as one flushed JSON line to the open binary file `fh` (a log such as
    `metrics.jsonl`: a crash can only leave a torn last line); the bytes written.

    Raises:
        CheckpointError: the write failed (a full disk, say), naming `path`.
    """
    line = (json.dumps(record, allow_nan=True) + "\n").encode("utf-8")
    try:
        fh.write(line)
        fh.flush()
    except OSError as exc:
        raise CheckpointError(
            f"cannot write '{path}': {describe_os_error(exc)}. The last saved "
            "checkpoint is intact: fix the problem and continue with --resume."
        ) from None
    return len(line)


def newest(paths: Iterable[Path]) -> Path | None:
    """The most recently written of `paths` that are files (by modification time, then by
    path: the same answer every time), or None when there are none."""
    found = [(path.stat().st_mtime_ns, str(path), path) for path in paths if path.is_file()]
    return max(found)[2] if found else None


def near_path(path: str | Path) -> Path | None:
    """An existing path a typo away from the missing `path`: each missing part replaced by the
    closest name in its folder (`checkpoint/tiny` -> `checkpoints/tiny`); None if there is none.
    """
    import difflib

    path = Path(path)
    current = Path(path.anchor) if path.is_absolute() else Path()
    for part in path.parts[1 if path.is_absolute() else 0 :]:
        if not (current / part).exists():
            try:
                names = [entry.name for entry in current.iterdir()]
            except OSError:
                return None
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.75)
            if not close:
                return None
            part = close[0]
        current = current / part
    return current if current != path else None


def remove_stale_temp_files(folder: Path) -> None:
    """Delete the temporary files that processes which are gone (killed part-way through a
    write) left in `folder`; nothing reads them. A live process's are its own to finish."""
    for tmp in folder.glob(TMP_GLOB):
        if not _writer_alive(tmp):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _writer_alive(tmp: Path) -> bool:
    """Whether the process named in a temporary file's name (`atomic_path`) still runs here."""
    pid = tmp.name.rpartition(TMP_MARK)[2]
    if not pid.isdigit() or int(pid) <= 0:
        return False
    if os.name == "nt":  # os.kill there ends the process: keep the file
        return True
    try:
        os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM), or a platform that cannot tell
        return True
    return True


# What `os.stat` can say a path is, besides a regular file or a folder.
_SPECIAL_KINDS = (
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def special_file_kind(path: str | Path) -> str | None:
    """What `path` is if it exists but is neither a regular file nor a folder ("a named pipe",
    "a socket", "a character device", "a block device"); None otherwise (missing included).

    Only stats the path: opening a named pipe to look would wait for a writer.
    """
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # missing, a broken link, a name the OS refuses
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return next((kind for is_kind, kind in _SPECIAL_KINDS if is_kind(mode)), "a special file")


def refuse_special_file(path: str | Path, name: str, wanted: str) -> None:
    """Refuse a path the user gave that is a named pipe, a socket or a device, unopened.

    Args:
        path: the path.
        name: how the message names it, e.g. "data.path ('corpus.txt')".
        wanted: what it should be, e.g. "a file or folder".

    Raises:
        InputError: `path` is neither a regular file nor a folder (see `special_file_kind`).
    """
    kind = special_file_kind(path)
    if kind is not None:
        raise InputError(
            f"{name} is {kind}, not {wanted}: llmcli reads only regular files, since {kind} "
            "has no fixed content (reading it could wait forever for a writer, or never end). "
            "Save the content to a file and give that file."
        )


def read_user_text(
    path: str | Path, what: str, *, kind: str = "text", hint: str = "check the path"
) -> str:
    """The UTF-8 text of a file the user named, or an `InputError` that says what is wrong.

    Args:
        path: the file.
        what: how the message names it, e.g. "config file" or "--data".
        kind: what the file should be, for the message about a folder ("YAML", "text").
        hint: what to do when the file does not exist.

    Raises:
        InputError: the file does not exist, is a folder, a named pipe, a socket or a device,
            cannot be read, or is not UTF-8.
    """
    p = Path(path)
    name = f"{what} {str(p)!r}"
    if not p.exists():
        raise InputError(f"{name} does not exist: {hint}.")
    if p.is_dir():
        raise InputError(f"{name} is a directory, not a {kind} file: give the file itself.")
    refuse_special_file(p, name, f"a {kind} file")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {name}: {exc.strerror or exc}.") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{name} is not UTF-8 text (bad byte at offset {exc.start}): is it a binary file? "
            "Text in another encoding converts with e.g. `iconv -f latin1 -t utf-8`."
        ) from None


class JSONFileError(ValueError):
    """A JSON file that cannot be read: missing, unreadable, not UTF-8, not JSON, or nested too
    deeply. `str()` says what is wrong in a few words; `cause` is the error underneath."""

    def __init__(self, problem: str, cause: BaseException) -> None:
        super().__init__(problem)
        self.cause = cause

    @property
    def missing(self) -> bool:
        return isinstance(self.cause, FileNotFoundError)


def read_json(path: str | Path) -> Any:
    """The JSON document in `path` (any JSON value: callers check its shape).

    Raises:
        JSONFileError: the file is missing, cannot be read, is not UTF-8 or not JSON, or
            nests lists or objects too deeply to read.
    """
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise JSONFileError(_json_problem(exc), exc) from None


def _json_problem(exc: BaseException) -> str:
    """What is wrong with a JSON file that could not be read, in a few words."""
    if isinstance(exc, UnicodeDecodeError):
        return f"it is not UTF-8 text (bad byte at offset {exc.start})"
    if isinstance(exc, json.JSONDecodeError):
        return f"it is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
    if isinstance(exc, RecursionError):
        return "it nests lists or objects too deeply to read"
    if isinstance(exc, OSError):
        return f"it cannot be read ({exc.strerror or exc})"
    return str(exc)
