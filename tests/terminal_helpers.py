"""The real command line in a pseudo-terminal of a chosen size, read as a user sees its screen.

`Terminal(args, columns=80)` starts `args` with a pty as its controlling terminal (so that
Ctrl-C, written as the byte 0x03, reaches it as SIGINT through the terminal, as a key press
does), and feeds what it writes to a `pyte` screen: carriage returns, cursor moves and line
clearing act as in a terminal, so `lines()` is what is left on screen, bar redraws included.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pyte

from llmcli.generation.interactive import CTRL_C_AT_PROMPT

CTRL_C = b"\x03"


def _controlling_terminal() -> None:
    # In the child, after `start_new_session` made it a session leader: the pty on fd 0
    # becomes its controlling terminal, and Ctrl-C its SIGINT (not ignored, whatever the
    # test runner's parent did).
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Terminal:
    """A process on a `columns` x `rows` pseudo-terminal, and the screen it draws."""

    def __init__(
        self,
        args: list[str],
        *,
        columns: int = 80,
        rows: int = 40,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        env = dict(os.environ if env is None else env, TERM="xterm")
        env.pop("COLUMNS", None)  # the width is the terminal's
        self.proc = subprocess.Popen(
            args,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=cwd,
            env=env,
            start_new_session=True,
            preexec_fn=_controlling_terminal,
        )
        os.close(slave)
        self.screen = pyte.Screen(columns, rows)
        self.stream = pyte.ByteStream(self.screen)
        self.raw = b""

    def _read(self, timeout: float) -> bool:
        """Take what the process wrote within `timeout` seconds; False at its end."""
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the process closed its side
            return False
        if not data:
            return False
        self.raw += data
        self.stream.feed(data)
        return True

    def text(self) -> str:
        """The screen's lines joined, as one string (a wrapped line reads on, with spaces)."""
        return " ".join(line.strip() for line in self.lines())

    def lines(self) -> list[str]:
        """The lines on screen, without trailing spaces and trailing empty lines."""
        lines = [line.rstrip() for line in self.screen.display]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    def wait_for(self, text: str, timeout: float = 120) -> None:
        """Read until `text` is on screen (or in what was written)."""
        self.wait_until(lambda: text in self.text() or text.encode() in self.raw, timeout)

    def wait_until(self, done: Callable[[], bool], timeout: float = 120) -> None:
        """Read what the process writes until `done()`."""
        deadline = time.monotonic() + timeout
        while not done():
            if not self._read(0.05) and self.proc.poll() is not None:
                raise AssertionError("ended before it was done:\n" + "\n".join(self.lines()))
            assert time.monotonic() < deadline, "timed out:\n" + "\n".join(self.lines())

    def press(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def wait(self, timeout: float = 120) -> int:
        """Read to the end of the process; its exit status."""
        deadline = time.monotonic() + timeout
        while self._read(0.05) or self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError("timed out:\n" + "\n".join(self.lines()))
        os.close(self.master)
        return self.proc.wait()


def ctrl_c_leaves_the_session_on(args: list[str], prompt: str, line: bytes, stopped: str) -> None:
    """An interactive command on a terminal: Ctrl-C as a key press and as SIGINT to the whole
    process group (what a terminal sends), each during an answer and at the prompt; the session
    goes on to answer the next line and ends at Ctrl-D with status 0."""
    term = Terminal(args, columns=80)
    try:
        term.wait_for("Ctrl-D exits")
        interrupts = [
            lambda: term.press(CTRL_C),
            lambda: os.killpg(term.proc.pid, signal.SIGINT),
        ]
        for n, interrupt in enumerate(interrupts, 1):
            term.wait_until(lambda: term.raw.endswith(prompt.encode()))
            term.press(line + b"\r")
            start = len(term.raw)
            term.wait_until(lambda start=start: len(term.raw) > start + 40)  # the answer streams
            interrupt()
            term.wait_until(lambda n=n: term.raw.count(stopped.encode()) == n)
        for n, interrupt in enumerate(interrupts, 1):  # at the prompt, a line half typed
            term.wait_until(lambda: term.raw.endswith(prompt.encode()))
            term.press(b"half a li")
            time.sleep(0.2)
            interrupt()
            term.wait_until(lambda n=n: term.raw.count(CTRL_C_AT_PROMPT.encode()) == n)
        time.sleep(1.0)  # a late end of the session would come now
        assert term.proc.poll() is None, "\n".join(term.lines())
        term.press(b"/settings\r")
        term.wait_for("max_new_tokens=")
        term.press(b"\x04")  # Ctrl-D
        assert term.wait(60) == 0, "\n".join(term.lines())
        assert b"Traceback" not in term.raw and b"interrupted" not in term.raw
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
