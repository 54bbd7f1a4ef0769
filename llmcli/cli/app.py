"""The `llmcli` Typer app and what its commands share: messages to stderr, the result as JSON or
text, streamed stdout.

The commands are in the modules beside this one, by what they work on; `llmcli.cli` gathers them
and holds `main`, which maps errors to exit statuses.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from llmcli import __version__


class PipeClosed(Exception):
    """The reader of stdout went away (`llmcli eval --per-token | head`)."""


class _Commands(TyperGroup):
    """The app's commands, with a closed stdout passed on as `PipeClosed`: Typer turns a
    `BrokenPipeError` into exit status 1 itself, which `main` could not tell from a failure."""

    def invoke(self, ctx: typer.Context) -> object:
        try:
            return super().invoke(ctx)
        except BrokenPipeError as exc:
            raise PipeClosed from exc


app = typer.Typer(
    name="llmcli",
    cls=_Commands,
    help="Train, sample and inspect small causal language models.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def notify(line: str) -> None:
    """Lines for the user that are not the command's result (which run, warnings) go to stderr,
    wrapped as every line there is (`wrap_for_stderr`)."""
    typer.echo(wrap_for_stderr(line), err=True)


def wrap_for_stderr(text: str) -> str:
    """`text` as stderr shows it: on a terminal, each line longer than its width wrapped at
    spaces (the terminal would break it mid-word), the rest indented; elsewhere as it is. Log
    lines, notices and `error:` messages all pass here, so all wrap alike."""
    import textwrap

    from llmcli.progress import stderr_columns, stderr_is_terminal

    columns = stderr_columns() if stderr_is_terminal() else None
    if not columns or all(len(line) < columns for line in text.splitlines()):
        return text
    wrap = textwrap.TextWrapper(
        columns - 1, break_long_words=False, break_on_hyphens=False, subsequent_indent="  "
    )
    return "\n".join(wrap.fill(line) for line in text.splitlines())


def result_text(result: Any, as_json: bool, format_text: Callable[[Any], str]) -> str:
    """A command's result as `--json` asks: its `to_dict()` as one line of JSON, else as text."""
    return json.dumps(result.to_dict()) if as_json else format_text(result)


class ThrottledStdout:
    """Writes to stdout, flushed at most every 50 ms: streamed text reaches the terminal
    promptly without one flush per token (the caller flushes at the end)."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.flushed = 0.0

    def __call__(self, text: str) -> None:
        sys.stdout.write(text)
        now = time.monotonic()
        if now - self.flushed >= self.interval_s:
            sys.stdout.flush()
            self.flushed = now


def log_to_stderr() -> None:
    """Show the library's INFO messages (run notes, plain progress lines) on stderr: whatever
    `sys.stderr` is when a message comes (a redirect, a caller's capture), not the one it was
    when logging was set up."""

    root = logging.getLogger()
    if not any(isinstance(h, Stderr) for h in root.handlers):
        handler = Stderr()
        handler.setFormatter(WrappedLines())
        root.addHandler(handler)
        root.setLevel(logging.INFO)


class Stderr(logging.StreamHandler):
    """`log_to_stderr`'s handler: writes to `sys.stderr` as it is when a message comes."""

    stream = property(lambda self: sys.stderr, lambda self, value: None)


def stop_logging_to_stderr() -> None:
    """Remove `log_to_stderr`'s handler (a command is over: a caller of `main` in the same
    process, a test say, sees no more of the library's log lines on its stderr)."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, Stderr)]:
        root.removeHandler(handler)


class WrappedLines(logging.Formatter):
    """A message as it is; on a terminal, wrapped at spaces to its width (the terminal would
    break it mid-word) and clearing its line. The bar's log handler takes this formatter too."""

    def format(self, record: Any) -> str:
        from llmcli.progress import stderr_is_terminal

        text = super().format(record)
        if not stderr_is_terminal():
            return text
        # Erase the rest of the line first: a key's echo (Ctrl-C's "^C") may sit beyond the
        # end of the bar this message takes the place of.
        return "\x1b[K" + wrap_for_stderr(text)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Train, sample and inspect small causal language models."""
