"""Reading windows of a token stream for the batches, with memory flat however large it is.

`WindowReader` reads windows of consecutive tokens at given starts: from a token file's
`np.memmap` (the token cache, `llmcli.data.token_cache`) with `os.pread`, so that no page of the
file is ever mapped into the process; from any other array by indexing.
"""

from __future__ import annotations

import mmap
import os

import numpy as np


def _file_region(tokens: np.ndarray) -> tuple[str, int] | None:
    """(file name, byte offset of `tokens[0]`) for a 1-D contiguous `np.memmap` (a view of one
    included), else None."""
    mm = getattr(tokens, "_mmap", None)
    if (
        not isinstance(tokens, np.memmap)
        or mm is None
        or tokens.filename is None
        or tokens.mode == "c"
        or tokens.ndim != 1
        or tokens.strides[0] != tokens.itemsize
    ):
        return None  # "c": copy-on-write, its changes are not in the file
    # The map starts at `offset` rounded down to the allocation granularity (numpy.memmap);
    # a view's first element lies `address - map address` bytes further.
    map_address = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    map_start = tokens.offset - tokens.offset % mmap.ALLOCATIONGRANULARITY
    offset = map_start + tokens.ctypes.data - map_address
    if offset < 0 or offset + tokens.nbytes > os.path.getsize(tokens.filename):
        return None
    return tokens.filename, offset


class WindowReader:
    """Windows of `length` consecutive tokens of a token stream, read at given starts.

    Memory stays flat however large the token file: from an `np.memmap`, each window is read
    with `os.pread` into the batch, so no page of the file is ever mapped into this process
    (touching a memory map instead adds the pages, often large folios, to the process's RSS
    until they are unmapped). Other arrays are indexed directly.
    """

    def __init__(self, tokens: np.ndarray, length: int) -> None:
        self.tokens, self.length = tokens, length
        self._offsets = np.arange(length)  # (L,)
        self._fd: int | None = None
        region = _file_region(tokens) if hasattr(os, "pread") else None
        if region is not None:
            self._fd = os.open(region[0], os.O_RDONLY | getattr(os, "O_BINARY", 0))
            self._file_offset = region[1]

    def read(self, starts: np.ndarray) -> np.ndarray:
        """`(B, L)` tokens from the window starts `(B,)`, as int64."""
        if self._fd is None:
            index = starts[:, None] + self._offsets  # (B, L)
            return np.asarray(self.tokens[index], dtype=np.int64)
        itemsize = self.tokens.itemsize
        n_bytes = self.length * itemsize
        raw = b"".join(
            os.pread(self._fd, n_bytes, self._file_offset + int(i) * itemsize) for i in starts
        )
        windows = np.frombuffer(raw, dtype=self.tokens.dtype)  # (B * L,)
        return windows.reshape(len(starts), -1).astype(np.int64)  # (B, L)

    def close(self) -> None:
        """Close the token file (also done when the reader is garbage-collected)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            try:
                self.close()
            except OSError:
                pass
