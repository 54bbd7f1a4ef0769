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


@app.command("sample")
def sample_command(
    checkpoint: Annotated[
        Optional[Path],
        typer.Option(
            help="Run directory (default: the latest run under checkpoints/).", metavar="DIR"
        ),
    ] = None,
    prompt: Annotated[
        Optional[str],
        typer.Option(
            help="Prompt text; '-' reads it from stdin (default: empty prompt).", metavar="TEXT"
        ),
    ] = None,
    prompt_file: Annotated[
        Optional[Path],
        typer.Option(
            help="File of prompts, one per line or a JSON list; all run as one batch.",
            metavar="FILE",
        ),
    ] = None,
    max_new_tokens: Annotated[
        Optional[int], typer.Option(help="Tokens to generate per sample (default: run config).")
    ] = None,
    temperature: Annotated[
        Optional[float], typer.Option(help="Sampling temperature, >= 0; 0 is greedy.")
    ] = None,
    top_k: Annotated[
        Optional[int],
        typer.Option(help="Keep the k most likely tokens (>= 1; >= vocab size keeps all)."),
    ] = None,
    top_p: Annotated[
        Optional[float], typer.Option(help="Nucleus sampling mass in (0, 1]; 1 keeps all.")
    ] = None,
    seed: Annotated[
        Optional[int], typer.Option(help="Random seed; sample r uses seed + r.")
    ] = None,
    num_samples: Annotated[int, typer.Option(help="Samples per prompt, run as one batch.")] = 1,
    stop: Annotated[
        Optional[list[str]],
        typer.Option(
            help="End a sample when this text appears (not printed); repeatable.",
            metavar="TEXT",
        ),
    ] = None,
    stream: Annotated[
        Optional[bool],
        typer.Option("--stream/--no-stream", help="Print tokens as they come (default: on a TTY)."),
    ] = None,
    json_: Annotated[
        bool,
        typer.Option("--json", help="One JSON object per sample (prompt, completion, tokens...)."),
    ] = False,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or mps.")] = "auto",
) -> None:
    """Generate text from a trained run (KV-cached, batched)."""
    import json

    from llmcli.generate import format_samples, read_prompts, sample_run

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    streaming = (sys.stdout.isatty() if stream is None else stream) and not json_
    samples = sample_run(
        checkpoint,
        read_prompts(prompt, prompt_file),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        num_samples=num_samples,
        stop=stop or [],
        device=device,
        write=write if streaming else None,
        notify=lambda line: typer.echo(line, err=True),
    )
    if json_:
        for sample in samples:
            typer.echo(json.dumps(sample.to_dict(), ensure_ascii=False))
    elif not streaming:
        write(format_samples(samples))


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
