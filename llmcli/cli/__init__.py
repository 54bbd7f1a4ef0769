"""The `llmcli` command line: thin commands that parse options and call the library.

`app` holds the Typer app; the commands sit in `training` (config, prepare-data, train, bench),
`plan` (plan), `generation` (sample, chat), `runs` (info, export, compare), `inside`
(inspect-attention, eval), `interpret` (lens, patch, attribute), `sae` (sae train, sae eval,
sae features), `graph` (graph) and `serve` (serve),
their shared options in `options`. Heavy libraries (torch, numpy, datasets, matplotlib,
transformers) are imported inside the commands that need them, so `llmcli --help` answers at once.
"""

from __future__ import annotations

import os
import sys

import typer

from llmcli.cli.app import PipeClosed, app, stop_logging_to_stderr, wrap_for_stderr
from llmcli.errors import InputError

# Importing the command modules registers their commands, in the order `llmcli --help` lists them.
# isort: off
from llmcli.cli import training, plan, generation, runs, inside, interpret, sae, graph, serve  # noqa: F401
# isort: on

__all__ = ["app", "main"]


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the app and maps errors to exit statuses (2 bad input, 130 Ctrl-C;
    `train` exits 143 after SIGTERM)."""
    args = sys.argv[1:] if argv is None else argv
    if sys.platform == "darwin":
        # Apple's MPS backend lacks some operations; with this set, they run on the CPU instead
        # of failing. torch reads it once, when it loads, so it is set before any command
        # imports torch; a value the user set wins.
        os.environ.setdefault("PYTORCH_ENABLE_MPS_FALLBACK", "1")
    try:
        code = _run(args)
    except InputError as exc:
        typer.echo(wrap_for_stderr(f"error: {exc}"), err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except (BrokenPipeError, PipeClosed):
        # Nothing more can be written: point stdout at /dev/null so that the flush at exit
        # does not fail again, and end as a pipe's reader expects, quietly.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout without a file descriptor (captured)
            pass
        sys.exit(0)
    except Exception as exc:
        # Typer ships its own copy of click, so match its exceptions by what they offer.
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):  # usage errors: exit 2
            _show_usage_error(exc, args)
            sys.exit(exc.exit_code)
        if hasattr(exc, "exit_code"):  # typer.Exit
            sys.exit(exc.exit_code)
        if type(exc).__name__ == "Abort":
            typer.echo("interrupted", err=True)
            sys.exit(130)
        raise
    sys.exit(code if isinstance(code, int) else 0)


def _run(args: list[str]) -> object:
    try:
        return app(args=args, prog_name="llmcli", standalone_mode=False)
    finally:
        stop_logging_to_stderr()


def _show_usage_error(exc: Exception, args: list[str]) -> None:
    """A usage error as click shows it, with `error:` spelt as every other error, and a hint for
    the commonest slip: `--set KEY VALUE` for `--set KEY=VALUE`."""
    ctx = getattr(exc, "ctx", None)
    if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
        # `llmcli` or `llmcli sae` alone: the help is the answer, not an error with it inside
        typer.echo(ctx.get_help(), err=True)
        return
    if ctx is not None:
        typer.echo(f"{ctx.get_usage()}\nTry '{ctx.command_path} -h' for help.\n", err=True)
    message = exc.format_message()  # type: ignore[attr-defined]
    for option, value, extra in zip(args, args[1:], args[2:], strict=False):
        if option == "--set" and "=" not in value and "unexpected extra argument" in message:
            message += f": --set takes KEY=VALUE as one word, e.g. --set {value}={extra}"
            break
    typer.echo(wrap_for_stderr(f"error: {message}"), err=True)
