"""`llmcli sample`: text from a trained run; `llmcli chat`: a conversation with a chat run."""

from __future__ import annotations

import sys
import typing
from collections.abc import Callable
from inspect import Parameter, Signature, signature
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional

import typer

from llmcli.cli.app import ThrottledStdout, app, notify
from llmcli.cli.options import CheckpointOption, DeviceOption, WeightsOption
from llmcli.config.sample import SETTING_KEYS, SampleConfig, option_name, setting_info
from llmcli.errors import InputError

if TYPE_CHECKING:
    from llmcli.generation.batching import SampleOptions
    from llmcli.generation.sample import HookFactory

# `llmcli sample`'s prompts and generation options; the sampling settings' options are made from
# `SampleConfig`'s fields (`sample_setting_options`).
PromptOption = Annotated[
    Optional[str],
    typer.Option(
        help="Prompt text; '-' reads it from stdin (default: empty prompt).", metavar="TEXT"
    ),
]
PromptFileOption = Annotated[
    Optional[Path],
    typer.Option(
        help="File of prompts, one per line or a JSON list; all run as one batch.", metavar="FILE"
    ),
]
ThreadsOption = Annotated[
    Optional[int],
    typer.Option(
        help="CPU threads (default: 1 for a small model decoding one token per step, else "
        "torch's own).",
        metavar="N",
    ),
]

NumSamplesOption = Annotated[int, typer.Option(help="Samples per prompt, run as one batch.")]
CompileOption = Annotated[
    bool,
    typer.Option(
        "--compile/--no-compile",
        help="Compile the decode step to C++ (AOTInductor; CPU, needs g++) where it measured "
        "faster: a model of at most 1M weights, at most 8 rows at a time (elsewhere the "
        "default step). About a minute the first time per run and batch size, kept in the "
        "compile cache; then 0.75-0.92x the default step's time.",
    ),
]
StopOption = Annotated[
    Optional[list[str]],
    typer.Option(
        help="End a sample when this text appears (not printed; \\n, \\t work); repeatable.",
        metavar="TEXT",
    ),
]
StreamOption = Annotated[
    Optional[bool],
    typer.Option("--stream/--no-stream", help="Print tokens as they come (default: on a TTY)."),
]
JsonOption = Annotated[
    bool,
    typer.Option("--json", help="One JSON object per sample (prompt, completion, tokens...)."),
]
InteractiveOption = Annotated[
    bool,
    typer.Option(
        "--interactive",
        "-i",
        help="Keep the model loaded and answer prompts read line by line from stdin (a "
        "terminal or a pipe), streamed; /temperature 0.5, /top_k 50, /seed 1... change the "
        "settings, /help lists them; Ctrl-C stops an answer, Ctrl-D exits.",
    ),
]
SteerOption = Annotated[
    Optional[list[str]],
    typer.Option(
        help="Add SCALE times an SAE feature's decoder direction at the SAE's hook point, at "
        "every position, while sampling (SCALE in the feature's activation units; `llmcli sae "
        "features` shows its usual size); repeatable.",
        metavar="SAE_DIR:FEATURE=SCALE",
    ),
]


def sample_setting_options(after: str) -> Callable[[Callable], Callable]:
    """Give a command an option for every `SampleConfig` setting, after its parameter `after`.

    Each option is made from the setting's field: its name (`--max-new-tokens`), type, help and
    metavar (`llmcli.config.sample.setting_info`); not given, it is None (the run's value).
    Typer reads a command's options from its signature: the command's `__signature__` becomes
    its own parameters with these inserted, and the command takes them as `**settings`.
    """

    def decorate(command: Callable) -> Callable:
        hints = typing.get_type_hints(SampleConfig)
        own = [
            p.replace(kind=Parameter.KEYWORD_ONLY)
            for p in signature(command, eval_str=True).parameters.values()
            if p.kind is not Parameter.VAR_KEYWORD
        ]
        at = [p.name for p in own].index(after) + 1
        settings = [_setting_parameter(key, hints[key]) for key in SETTING_KEYS]
        command.__signature__ = Signature(own[:at] + settings + own[at:])  # type: ignore[attr-defined]
        return command

    return decorate


def _setting_parameter(key: str, annotation: Any) -> Parameter:
    """The Typer option of the setting `key` (declared `annotation`), None when not given."""
    info = setting_info(key)
    flags = [f"{option_name(key)}/{info['off_option']}"] if info["off_option"] else []
    help_ = info["help"].removesuffix(".") + f" (default: the run's sample.{key})."
    option = typer.Option(*flags, help=help_, metavar=info["metavar"])
    typed = Annotated[Optional[_option_type(annotation)], option]
    return Parameter(key, Parameter.KEYWORD_ONLY, default=None, annotation=typed)


def _option_type(annotation: Any) -> type:
    """The command-line type of a setting: `int | None` -> int; a `Literal` of strings -> str
    (`SampleConfig` checks the choice, and its message names the choices)."""
    if typing.get_origin(annotation) is Literal:
        return type(typing.get_args(annotation)[0])
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return _option_type(args[0]) if args else annotation


@app.command("sample")
@sample_setting_options(after="prompt_file")
def sample_command(
    checkpoint: CheckpointOption = None,
    prompt: PromptOption = None,
    prompt_file: PromptFileOption = None,
    num_samples: NumSamplesOption = 1,
    stop: StopOption = None,
    stream: StreamOption = None,
    json_: JsonOption = False,
    threads: ThreadsOption = None,
    interactive: InteractiveOption = False,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
    steer: SteerOption = None,
    compile_: CompileOption = False,
    **settings: Any,
) -> None:
    """Generate text from a trained run (KV-cached, batched), or talk to it (--interactive)."""
    import json

    from llmcli.generation.prompts import read_prompts
    from llmcli.generation.sample import format_samples, sample_run

    write = ThrottledStdout()
    options = _sample_options(
        stop, threads, weights, device, num_samples=num_samples, compile_=compile_
    )
    hooks = _steering(steer)
    overrides = _given(settings)
    if interactive:
        if prompt_file is not None or json_:
            raise InputError(
                "--interactive reads its prompts from stdin: leave out --prompt-file and --json."
            )
        _interactive(checkpoint, prompt, overrides, options, hooks, write)
        return
    streaming = (sys.stdout.isatty() if stream is None else stream) and not json_
    prompts = read_prompts(prompt, prompt_file)
    samples = sample_run(
        checkpoint,
        prompts,
        overrides,
        options,
        hooks=hooks,
        write=write if streaming else None,
        notify=notify,
    )
    if json_:
        for sample in samples:
            typer.echo(json.dumps(sample.to_dict(), ensure_ascii=False))
    elif not streaming:
        write(format_samples(samples))
    sys.stdout.flush()


def _sample_options(
    stop: Optional[list[str]],
    threads: Optional[int],
    weights: str,
    device: str,
    num_samples: int = 1,
    compile_: bool = False,
) -> SampleOptions:
    """`sample`'s and `chat`'s options around generation: --stop's texts (\\n, \\t unescaped),
    --threads, --weights, --device and `sample`'s --num-samples and --compile."""
    from llmcli.generation.batching import SampleOptions
    from llmcli.generation.prompts import unescape

    return SampleOptions(
        num_samples=num_samples,
        stop=tuple(unescape(text) for text in stop or []),
        threads=threads,
        weights=weights,
        device=device,
        compile=compile_,
    )


def _given(settings: dict[str, Any]) -> dict[str, Any]:
    """The sampling settings given as options: they change the run's sample: config (None: not
    given, the run's value stays)."""
    return {key: value for key, value in settings.items() if value is not None}


def _steering(steer: Optional[list[str]]) -> HookFactory | None:
    """`--steer`'s hook functions (`llmcli.inspection.sae.steer`), made once the run is
    loaded: the specs are checked against its model, after it loads and before any output;
    None without one."""
    if not steer:
        return None
    from llmcli.inspection.sae.steer import steering_hooks

    specs = tuple(steer)
    return lambda model: steering_hooks(model, specs)


def _interactive(
    checkpoint: Optional[Path],
    prompt: Optional[str],
    overrides: dict,
    options: SampleOptions,
    hooks: HookFactory | None,
    write: ThrottledStdout,
) -> None:
    """`sample --interactive`: load the run once, then answer stdin's lines (a first --prompt)."""
    from llmcli.generation.interactive import interactive
    from llmcli.generation.sample import hooked, load_for_sampling

    run, config, options = load_for_sampling(checkpoint, overrides, options, notify)
    read_line = _stdin_lines(
        "> ",
        f"{run.run_dir}: type a prompt; /help lists the commands, Ctrl-D exits",
        first=prompt,
    )
    with hooked(run.model, hooks):
        interactive(run, config, options, read_line, write, notify)
    sys.stdout.flush()


def _stdin_lines(
    tty_prompt: str, greeting: str, first: Optional[str] = None
) -> Callable[[], str | None]:
    """The `read_line` of a session on stdin: the line `first` if given, then a terminal's lines
    typed after `tty_prompt` (with line editing; `greeting` is said first), or a pipe's; None at
    the end of the input."""
    from llmcli.generation.interactive import decode_line, not_utf8

    pending = [first] if first is not None else []
    tty = sys.stdin.isatty()
    if tty:
        import readline  # noqa: F401  (line editing and history for input())
    greet = [greeting] if tty else []
    # A pipe is read as bytes, each line decoded alone: bytes that are not UTF-8 are that line's
    # error, where text-mode stdin would stop the session (or, under some locales, pass them on
    # as surrogates).
    stdin = getattr(sys.stdin, "buffer", None)

    def read_line() -> str | None:
        # Greeted at the first read, inside the session's loop: a Ctrl-C pressed as soon as
        # the greeting shows is the loop's to handle, as every later one is.
        if greet:
            notify(greet.pop())
        sys.stdout.flush()
        if pending:
            return pending.pop()
        if tty:
            try:
                return input(tty_prompt)
            except EOFError:
                return None
            except KeyboardInterrupt:
                print(file=sys.stderr)  # end the prompt's line, as a shell does
                raise
            except UnicodeDecodeError as exc:
                raise not_utf8(exc) from None
        if stdin is None:  # a text stream standing in for stdin (tests)
            line = sys.stdin.readline()
            return line.rstrip("\r\n") if line else None
        data = stdin.readline()
        return decode_line(data) if data else None

    return read_line


SystemOption = Annotated[
    Optional[str],
    typer.Option(
        help="The system message the conversation starts with (/system TEXT changes it).",
        metavar="TEXT",
    ),
]


@app.command("chat")
@sample_setting_options(after="system")
def chat_command(
    checkpoint: CheckpointOption = None,
    system: SystemOption = None,
    stop: StopOption = None,
    threads: ThreadsOption = None,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
    steer: SteerOption = None,
    **settings: Any,
) -> None:
    """Talk with a chat run: one message per line from stdin (a terminal or a pipe), each reply
    printed (on a pipe, as one line: newlines in it written \\n); /reset, /system TEXT, /quit,
    /help; Ctrl-C stops a reply, Ctrl-D exits."""
    from llmcli.generation.chat import chat, open_session
    from llmcli.generation.sample import hooked

    options = _sample_options(stop, threads, weights, device)
    hooks = _steering(steer)
    overrides = _given(settings)
    session = open_session(checkpoint, system, overrides, options, notify)
    read_line = _stdin_lines(
        "you> ", f"{session.run.run_dir}: type a message; /help lists the commands, Ctrl-D exits"
    )
    one_line = not sys.stdout.isatty()
    with hooked(session.run.model, hooks):
        chat(session, read_line, ThrottledStdout(), notify, one_line=one_line)
    sys.stdout.flush()
