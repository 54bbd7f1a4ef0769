"""`llmcli sample --interactive`: one loaded model, prompts read line by line, answers streamed.

Each line read is a prompt (`\\n` and `\\t` in it are a newline and a tab, as in `--stop`),
answered with `sample_texts`, the code `llmcli sample` runs, so an answer is exactly what
`llmcli sample --prompt LINE` prints with the same settings: every answer draws from a generator
seeded with the current `seed`. A line starting with `/` changes a setting instead
(`/temperature 0.5`, `/top_k 50`, `/seed 1`, any `SampleConfig` key, its value a YAML scalar as
in `--set`), checked by `SampleConfig` through `dataclasses.replace`: a bad value is reported and
the previous one kept. `/settings` shows them, `/help` the commands with each setting's help
from `SampleConfig`. Ctrl-C (`KeyboardInterrupt`) during an answer stops that answer, and at the
prompt drops the line (`CTRL_C_AT_PROMPT`): it never ends the session. The end of the input
(Ctrl-D) or a quit line (`is_quit`: /quit, /exit, /bye, `quit` or `exit`, as in `llmcli chat`)
ends the session. A line that cannot be answered (bytes that are not UTF-8, characters outside
the vocabulary, a bad command) gets its reason and the session goes on; a
prompt longer than the context is answered from its last `context_length` tokens, with a notice.

Answers go to `write` (stdout), everything else (settings, errors, help) to `notify` (stderr),
so that the output of a piped session is the answers alone.
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from llmcli.config import SampleConfig
from llmcli.config.loading import format_scalar, parse_scalar
from llmcli.config.sample import SETTING_KEYS, broken_rule, setting_info
from llmcli.errors import InputError, did_you_mean
from llmcli.generation.batching import SampleOptions, sample_texts
from llmcli.generation.prompts import unescape
from llmcli.generation.threads import sample_threads, torch_threads
from llmcli.runs.loading import LoadedRun

logger = logging.getLogger(__name__)

_WIDTH = 79  # of /help's lines
# The lines that end an interactive session (`sample --interactive`, `chat`), as Ctrl-D does.
QUIT_LINES = ("/quit", "/exit", "/bye", "/q", "quit", "exit")
# Said for a Ctrl-C that lands outside an answer (at the prompt, or just after an answer
# stopped): as in Python's REPL and a shell, it drops the line and never ends the session, so
# that a press just as an answer ends cannot take the session with it.
CTRL_C_AT_PROMPT = "Ctrl-C: the line is dropped; Ctrl-D or /quit ends the session"


def is_quit(line: str) -> bool:
    """Whether `line` ends the session: /quit, /exit, /bye, or `quit` or `exit` alone."""
    return line.strip() in QUIT_LINES


def help_text(config: SampleConfig) -> str:
    """`/help`: a command per setting, with its current value and its help from `SampleConfig`."""
    commands = {f"/{key} {format_scalar(getattr(config, key))}": key for key in SETTING_KEYS}
    width = max(map(len, commands)) + 4  # the column of the help texts
    nullable = " and ".join(key for key in SETTING_KEYS if broken_rule(key, None) is None)
    changing = (
        f"/KEY VALUE changes a setting; VALUE is a YAML scalar as in --set ({nullable} take "
        "null). The settings, as they are now:"
    )
    return "\n".join(
        [
            "Type a prompt and press Enter: the answer is streamed (\\n in a prompt is a newline).",
            textwrap.fill(changing, _WIDTH),
            *(
                textwrap.fill(
                    setting_info(key)["help"],
                    _WIDTH,
                    initial_indent=f"  {command:<{width - 2}}",
                    subsequent_indent=" " * width,
                )
                for command, key in commands.items()
            ),
            "  /settings  show the settings    /help  this text",
            "  /quit      end the session (also /exit, /bye, or `quit` or `exit` alone)",
            "Ctrl-C stops the current answer (at the prompt, drops the line); Ctrl-D exits too.",
        ]
    )


def format_settings(config: SampleConfig) -> str:
    """The settings as one line: `temperature=0.8 top_k=200 ...`."""
    return " ".join(f"{key}={getattr(config, key)}" for key in SETTING_KEYS)


def complete_command(name: str, commands: tuple[str, ...]) -> str:
    """The command `name` stands for: itself when it is one, else the only one of `commands` it
    begins (`temp` -> `temperature`, as a shell completes), else `name` as it is (an unknown
    or ambiguous prefix, which the caller reports with its near matches)."""
    if name in commands:
        return name
    started = [command for command in commands if name and command.startswith(name)]
    return started[0] if len(started) == 1 else name


def apply_command(config: SampleConfig, line: str, context_length: int) -> tuple[SampleConfig, str]:
    """Run one `/command` line: the settings after it and the line to show.

    Args:
        config: the current settings.
        line: `/help`, `/settings`, or `/KEY VALUE` with KEY a `SampleConfig` field (dashes
            allowed) and VALUE a YAML scalar.
        context_length: the model's, which `context_keep` must be below.

    Raises:
        InputError: an unknown command, a missing value, a value that is not a YAML scalar, or
            one `SampleConfig` refuses (its message names the setting, the value and the rule).
    """
    name, _, raw = line[1:].strip().partition(" ")
    key = complete_command(name.replace("-", "_"), ("help", "settings", *SETTING_KEYS))
    if key in ("help", "h", "?"):
        return config, help_text(config)
    if key == "settings":
        return config, format_settings(config)
    if key not in SETTING_KEYS:
        hint = did_you_mean(f"/{key}", [f"/{k}" for k in SETTING_KEYS], " Did you mean {}?")
        raise InputError(
            f"unknown command /{name}.{hint} The settings are /{', /'.join(SETTING_KEYS)}; "
            "/settings shows them, /help the commands, /quit ends the session."
        )
    if not raw.strip():
        raise InputError(f"/{key} needs a value, e.g. /{key} {getattr(config, key)}")
    value = parse_scalar(raw, f"/{key} {raw.strip()}", f'/{key} "..."')
    new = replace(config, **{key: value})
    new.keep_for(context_length)
    return new, f"{key} = {getattr(new, key)}"


@dataclass
class _Stream:
    """The text sink of one answer: writes pieces as they come, remembers the last one."""

    write: Callable[[str], Any]
    last: str = "\n"

    def text(self, index: int, piece: str) -> None:
        # Set first: Ctrl-C may land inside `write`, after the piece is out.
        self.last = piece[-1]
        self.write(piece)

    def end(self, index: int) -> None:
        pass


def decode_line(data: bytes) -> str:
    """A line read from stdin as text, without its line ending.

    Raises:
        InputError: the line is not UTF-8; the message says where and how to convert it.
    """
    try:
        return data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise not_utf8(exc) from None


def not_utf8(exc: UnicodeDecodeError) -> InputError:
    """The error for a line of input that `exc` found is not UTF-8."""
    return InputError(
        f"the line is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}): "
        "type or pipe UTF-8 (text in another encoding converts with e.g. "
        "`iconv -f latin1 -t utf-8`)."
    )


def answer(
    run: LoadedRun,
    prompt: str,
    config: SampleConfig,
    options: SampleOptions,
    write: Callable[[str], Any],
    notify: Callable[[str], Any] = logger.warning,
) -> bool:
    """Stream the answer to `prompt`, ending it with a newline; False when Ctrl-C stopped it.

    Raises:
        InputError: the prompt cannot be encoded (see `llmcli.generation.prompts.encode_prompt`).
    """
    stream = _Stream(write)
    stopped = False
    try:
        with torch_threads(sample_threads(run.model, config, options.threads)):
            sample_texts(
                run.model, run.tokenizer, [prompt], config, options, sink=stream, notify=notify
            )
    except KeyboardInterrupt:
        stopped = True
    finally:
        if stream.last != "\n":
            write("\n")
    if stopped:
        notify("stopped (Ctrl-C); the next prompt, or Ctrl-D to exit")
    return not stopped


def interactive(
    run: LoadedRun,
    config: SampleConfig,
    options: SampleOptions,
    read_line: Callable[[], str | None],
    write: Callable[[str], Any],
    notify: Callable[[str], Any] = logger.warning,
) -> int:
    """Answer prompts until `read_line` returns None (end of input).

    Args:
        run: the loaded run (see `llmcli.generation.sample.load_for_sampling`).
        config: the starting settings.
        options: stop strings and ids, threads (`num_samples` must be 1).
        read_line: the next line without its newline, or None at the end of the input; it
            raises `InputError` for a line that is not text (see `decode_line`).
        write: receives the answers' text as it is generated (flushed by the caller's writer).
        notify: receives settings, help and error lines.

    Returns:
        The number of prompts answered (to the end or stopped).
    """
    if options.num_samples != 1:
        raise InputError("--interactive answers each prompt once: leave out --num-samples.")
    answered = 0
    while True:
        # A line that cannot be read, run or answered gets its reason, and the next line its
        # turn: one bad line in a piped script must not leave the rest unanswered.
        try:
            if (line := read_line()) is None or is_quit(line):
                return answered
            if line.startswith("/"):
                config, message = apply_command(config, line, run.model.context_length)
                notify(message)
            elif line.strip():
                answer(run, unescape(line), config, options, write, notify)
                answered += 1
        except InputError as exc:
            notify(f"error: {exc}")
        except KeyboardInterrupt:
            notify(CTRL_C_AT_PROMPT)
