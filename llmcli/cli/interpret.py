"""`llmcli lens`, `patch` and `attribute`: what each layer predicts, which activations carry the
answer, and which parts write it directly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmcli.cli.app import app, notify, result_text
from llmcli.cli.options import CheckpointOption, DeviceOption, JsonOption, WeightsOption

PromptOption = Annotated[
    str,
    typer.Option(help="The prompt text (at most context_length tokens).", metavar="TEXT"),
]
AnswerOption = Annotated[
    str,
    typer.Option(
        help="The answer's text, exactly one token, read at the prompt's last position.",
        metavar="TOK",
    ),
]
WrongOption = Annotated[
    Optional[str],
    typer.Option(
        help="A wrong answer's text, one token: the metric is then logit(answer) - "
        "logit(wrong). Without it, patch measures the log-prob of --answer and attribute "
        "its logit.",
        metavar="TOK",
    ),
]


def _out_option(name: str) -> object:
    return typer.Option("--out", help=f"Output folder (default: <run>/{name}/).", metavar="DIR")


def _report(result: Any, files: list[Path], json_: bool, format_text: Callable[[Any], str]) -> None:
    """The result on stdout (text, or one line of JSON with --json); on stderr, the files it was
    written to, then the run's viewer pages that now show it."""
    typer.echo(result_text(result, json_, format_text), nl=json_)
    folder = files[0].parent
    notify(f"wrote {folder}/: " + ", ".join(p.name for p in files if p.parent == folder))
    pages = [str(p) for p in files if p.parent != folder]
    if pages:
        notify("updated the viewer: " + ", ".join(pages))


@app.command("lens")
def lens_command(
    prompt: PromptOption,
    checkpoint: CheckpointOption = None,
    out: Annotated[Optional[Path], _out_option("lens")] = None,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
    json_: JsonOption = False,
) -> None:
    """Logit lens: the final norm and LM head applied after every layer, per position."""
    from llmcli.inspection.answers import RunOptions
    from llmcli.inspection.lens import format_lens, run_lens

    options = RunOptions(checkpoint, weights, device, out)
    result, files = run_lens(options, prompt, notify=notify)
    _report(result, files, json_, format_lens)


@app.command("patch")
def patch_command(
    clean: Annotated[str, typer.Option(help="The clean prompt text.", metavar="TEXT")],
    corrupt: Annotated[
        str,
        typer.Option(
            help="The corrupted prompt text, of as many tokens as --clean.", metavar="TEXT"
        ),
    ],
    answer: AnswerOption,
    wrong: WrongOption = None,
    checkpoint: CheckpointOption = None,
    out: Annotated[Optional[Path], _out_option("patch")] = None,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
    json_: JsonOption = False,
) -> None:
    """Activation patching: how much of the clean answer each clean activation restores."""
    from llmcli.inspection.answers import RunOptions
    from llmcli.inspection.patching import format_patch, run_patch

    options = RunOptions(checkpoint, weights, device, out)
    result, files = run_patch(options, clean, corrupt, (answer, wrong), notify=notify)
    _report(result, files, json_, format_patch)


@app.command("attribute")
def attribute_command(
    prompt: PromptOption,
    answer: AnswerOption,
    wrong: WrongOption = None,
    checkpoint: CheckpointOption = None,
    out: Annotated[Optional[Path], _out_option("attribute")] = None,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
    json_: JsonOption = False,
) -> None:
    """Direct logit attribution: each head's, MLP's and the embedding's part of the answer."""
    from llmcli.inspection.answers import RunOptions
    from llmcli.inspection.attribution import format_attribution, run_attribution

    options = RunOptions(checkpoint, weights, device, out)
    result, files = run_attribution(options, prompt, (answer, wrong), notify=notify)
    _report(result, files, json_, format_attribution)
