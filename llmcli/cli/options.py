"""The command line's options: aliases several commands share, and options with an optional value.

The aliases are declared once, so that the commands' names, help and defaults for an option agree.
`train --resume` and the `--ablation` of `eval` and `inspect-attention` may be given without a
value, which Typer cannot say: their commands parse them through `OptionalValueCommand`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar, Optional

import typer
from typer.core import TyperCommand

SetOption = Annotated[
    Optional[list[str]],
    typer.Option(
        "--set",
        help="Override one config value, as section.key=value (YAML scalar); repeatable.",
        metavar="KEY=VALUE",
    ),
]


ConfigArg = Annotated[
    Path,
    typer.Argument(
        help="A YAML config file (e.g. my.yaml) or a shipped config's name (e.g. tiny; "
        "`llmcli config --list` lists them).",
        metavar="CONFIG",
    ),
]


# Options several commands share: declared once, so that their names, help and defaults agree.
CheckpointOption = Annotated[
    Optional[Path],
    typer.Option(
        help="Run directory, or a weights file in one (default: the latest run under "
        "checkpoints/).",
        metavar="DIR",
    ),
]
WeightsOption = Annotated[
    str, typer.Option(help="Which weights of the run: best or last.", metavar="WHICH")
]
DeviceOption = Annotated[str, typer.Option(help="auto, cpu, cuda or mps.", metavar="DEVICE")]
# plan's and bench's, which take a CONFIG: its train.device is the default.
ConfigDeviceOption = Annotated[
    Optional[str],
    typer.Option(help="auto, cpu, cuda or mps (default: train.device).", metavar="DEVICE"),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]
DataOption = Annotated[
    Optional[Path],
    typer.Option(
        help="A UTF-8 text file to measure on, in windows of context_length tokens (default: "
        "the run's validation split).",
        metavar="PATH",
    ),
]
RunThreadsOption = Annotated[
    Optional[int],
    typer.Option(
        help="CPU threads (default: the run's train.threads); more pays only on cores that "
        "nothing else uses.",
        metavar="N",
    ),
]
ProgressOption = Annotated[
    bool,
    typer.Option(help="Show progress: a bar on a terminal, plain lines in a log or pipe."),
]


class UsageCommand(TyperCommand):
    """A command whose usage line names its arguments as click does: `CONFIG`, `[CONFIG]`,
    `RUN...`. Typer writes a required one in braces (`{CONFIG}`), which reads as if the braces
    were to be typed."""

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name != "argument":
                continue
            name = param.metavar or (param.name or "").upper()
            if param.nargs != 1 and not name.endswith("..."):
                name += "..."
            pieces.append(name if param.required else f"[{name}]")
        return pieces


# Options whose value may be left out: `train --resume` (strict) or `--resume auto`, and
# `--ablation` (zero) or `--ablation mean|both` of `eval` and `inspect-attention`.
@dataclass(frozen=True)
class _Bare:
    """What an option means when given without a value.

    Attributes:
        value: the value a bare option gets.
        values: the option's only values, if it has a fixed few: then a token after it that is
            none of them is not its value (`train --resume tiny` is CONFIG tiny).
    """

    value: str
    values: tuple[str, ...] | None = None

    def is_bare_before(self, token: str | None) -> bool:
        """Whether the option is bare when `token` follows it (None: nothing follows)."""
        if token is None or token.startswith("-"):
            return True
        return self.values is not None and token not in self.values


class OptionalValueCommand(UsageCommand):
    """A command whose options in `bare` may be given without a value.

    Typer has no options with an optional value (it ignores click's `is_flag=False,
    flag_value=...`), and its parser gives an option that takes a value the next token, whatever
    it is. So this command's parse step first writes a bare option with its value (`--resume`
    becomes `--resume=strict`), then parses as any command does. A token that is another
    option's value (`--prompt --ablation`) and every token after `--` stay as they are; a value
    given explicitly (`--resume=later`) is checked by the command.
    """

    bare: ClassVar[dict[str, _Bare]] = {}

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, self._with_bare_values(ctx, args))

    def _with_bare_values(self, ctx: typer.Context, args: list[str]) -> list[str]:
        takes_values = {  # option -> how many tokens after it are its value
            name: param.nargs
            for param in self.get_params(ctx)
            if param.param_type_name == "option" and not (param.is_flag or param.count)
            for name in param.opts
        }
        out: list[str] = []
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                return out + args[i:]
            after = args[i + 1] if i + 1 < len(args) else None
            if arg in self.bare and self.bare[arg].is_bare_before(after):
                out.append(f"{arg}={self.bare[arg].value}")
                i += 1
            else:  # an option that takes values keeps the tokens after it as they are
                step = 1 + takes_values.get(arg, 0)
                out += args[i : i + step]
                i += step
        return out


# `--resume`'s values, and what `train` takes for each.
RESUME_VALUES = {"strict": True, "auto": "auto"}


class TrainCommand(OptionalValueCommand):
    bare: ClassVar[dict[str, _Bare]] = {"--resume": _Bare("strict", tuple(RESUME_VALUES))}


class AblationCommand(OptionalValueCommand):
    bare: ClassVar[dict[str, _Bare]] = {"--ablation": _Bare("zero")}
