"""The `llmcli` command line: thin commands that parse options and call the library.

Heavy libraries (torch, numpy, datasets, matplotlib, transformers) are imported inside the
commands that need them, so `llmcli --help` answers at once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmcli import __version__
from llmcli.errors import InputError

app = typer.Typer(
    name="llmcli",
    help="Train, sample and inspect small causal language models.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

SetOption = Annotated[
    Optional[list[str]],
    typer.Option(
        "--set",
        help="Override one config value, as section.key=value (YAML scalar); repeatable.",
        metavar="KEY=VALUE",
    ),
]


ConfigArg = Annotated[
    Path, typer.Argument(help="A YAML config file, e.g. configs/tiny.yaml.", metavar="CONFIG")
]


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


@app.command("config")
def config_command(
    config: ConfigArg,
    set_: SetOption = None,
) -> None:
    """Validate a config and print it fully resolved (every default filled in)."""
    from llmcli.config import dump_yaml, load_config

    typer.echo(dump_yaml(load_config(config, set_ or [])), nl=False)


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the app and maps errors to exit statuses (2 bad input, 130 Ctrl-C)."""
    try:
        code = app(args=argv, prog_name="llmcli", standalone_mode=False)
    except InputError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as exc:
        # Typer ships its own copy of click, so match its exceptions by what they offer.
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):  # usage errors: exit 2
            exc.show()
            sys.exit(exc.exit_code)
        if hasattr(exc, "exit_code"):  # typer.Exit
            sys.exit(exc.exit_code)
        if type(exc).__name__ == "Abort":
            typer.echo("interrupted", err=True)
            sys.exit(130)
        raise
    sys.exit(code if isinstance(code, int) else 0)
