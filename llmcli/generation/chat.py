"""`llmcli chat`: a conversation with a chat run, one user turn at a time, through its template.

A `ChatSession` holds the conversation: an optional system message and the user and assistant
turns so far. `reply(text)` renders the conversation with the run's chat template
(`llmcli.data.conversations.ConversationEncoder.prompt`) and generates the assistant's turn with
`sample_batch`, the code `llmcli sample` and `llmcli serve` run, from a generator seeded with the
session's `seed`: a reply is exactly what `POST /v1/chat/completions` answers for the same
messages and seed. A reply ends at a chat token (`<|end|>`, or a role marker, which can only start
another turn and would make the history one no template accepts), the end-of-text token, a stop
string or `max_new_tokens`; its text holds none of them.

The history is cut at turn boundaries to fit the context: the oldest user+assistant pairs are
left out of the prompt (the system message stays) until the prompt leaves room for the reply,
`max_new_tokens` or half the context if that is less (`reply_room`). A reply that outgrows the
room goes on under the context policy (`sample.context_policy`), as a sample does; a last user
turn longer than the context is cut to the last `context_length` tokens, with a notice.

`chat(session, read_line, write, notify)` runs a session over lines of input, as
`llmcli.generation.interactive` runs `sample --interactive`: each line is a user turn (`\\n` in
it is a newline); `/reset`, `/system TEXT`, `/quit`, `/help` and the sampling settings' commands
(`/temperature 0.5`, `/settings`) act on the session; a line that fails gets its reason on
`notify` and the session goes on; Ctrl-C stops a reply, which is then left out of the history.
With `one_line`, a reply is written as one line, its newlines and backslashes escaped as `\\n`
and `\\\\` (the escapes a user line takes), so that a script reads one line per turn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llmcli.config import SampleConfig
from llmcli.config.sample import SETTING_KEYS
from llmcli.data.chat_template import CHAT_TOKENS, require_run_template
from llmcli.data.conversations import ConversationEncoder, Messages, check_messages
from llmcli.errors import InputError, did_you_mean
from llmcli.generation.batching import Sample, SampleJob, SampleOptions, sample_batch
from llmcli.generation.interactive import (
    CTRL_C_AT_PROMPT,
    apply_command,
    complete_command,
    format_settings,
    is_quit,
)
from llmcli.generation.prompts import crop_chat_prompt, unescape
from llmcli.generation.sample import load_for_sampling
from llmcli.generation.streaming import TextSink
from llmcli.generation.threads import sample_threads, torch_threads
from llmcli.runs.loading import LoadedRun

logger = logging.getLogger(__name__)

HELP = """\
Type a message and press Enter: the reply follows (\\n in a message is a newline; a line
starting with // is a message starting with /).
  /reset        forget the conversation (the system message stays)
  /system TEXT  set the system message; /system alone removes it
  /settings     show the sampling settings; /KEY VALUE changes one ({keys})
  /quit         end the session, as Ctrl-D does (also /exit, /bye, `quit` or `exit` alone)
  /help         this text
Ctrl-C stops the current reply (it is left out of the conversation); at the prompt it drops
the line. Ctrl-D ends the session."""


def reply_room(config: SampleConfig, context_length: int) -> int:
    """The tokens a prompt leaves free for the reply: `max_new_tokens`, at most half the context
    (so that a long `max_new_tokens` does not leave every earlier turn out)."""
    return min(config.max_new_tokens, max(1, context_length // 2))


def fit_history(
    encoder: ConversationEncoder,
    head: Messages,
    turns: Messages,
    user: str,
    room: int,
    context_length: int,
) -> tuple[Messages, list[int], int]:
    """The prompt answering `user`: the oldest user+assistant pairs of `turns` left out until
    the prompt's ids and `room` fit `context_length` (or none are left).

    Args:
        encoder: the run's template and tokenizer.
        head: what every prompt starts with (the system message, if any).
        turns: the conversation's user and assistant turns so far, in pairs.
        user: the text to answer.
        room: the tokens to leave for the reply (`reply_room`).
        context_length: the model's.

    Returns:
        The prompt's messages, their ids (ending with the start of the reply), and the number of
        pairs left out.
    """
    last = {"role": "user", "content": user}
    dropped = 0
    while True:
        messages = [*head, *turns[2 * dropped :], last]
        ids = encoder.prompt(check_messages(messages, "the conversation", complete=False))
        if len(ids) + room <= context_length or 2 * dropped >= len(turns):
            return messages, ids, dropped
        dropped += 1


def reply_stop_ids(encoder: ConversationEncoder) -> tuple[int, ...]:
    """The ids that end a reply: the tokens every reply ends at (`<|end|>`, the end of text:
    `ConversationEncoder.reply_end_ids`) and the role markers (each the start of a turn)."""
    ids = list(encoder.reply_end_ids)
    for token in CHAT_TOKENS:
        piece = encoder.tokenizer.encode(token)
        if len(piece) == 1 and piece[0] not in ids:
            ids.append(piece[0])
    return tuple(ids)


def check_system(text: str) -> str:
    """A system message, or the `InputError` of text no turn may hold (a chat token)."""
    system = [{"role": "system", "content": text}, {"role": "user", "content": ""}]
    check_messages(system, "the system message", complete=False)
    return text


@dataclass
class ChatSession:
    """One conversation with a loaded chat run.

    Attributes:
        run: the run (its model in eval mode).
        encoder: its template and tokenizer (`open_session` makes it).
        config: the sampling settings; every reply draws from a generator seeded `config.seed`.
        options: stop strings and ids (the run's end-of-text and the chat tokens), threads.
        system: the system message, or None.
        turns: the user and assistant turns so far, in pairs.
        dropped: pairs the last prompt left out to fit the context.
    """

    run: LoadedRun
    encoder: ConversationEncoder
    config: SampleConfig
    options: SampleOptions
    system: str | None = None
    turns: Messages = field(default_factory=list)
    dropped: int = 0

    def prompt(self, user: str) -> tuple[list[int], int]:
        """The ids of the prompt answering `user` (see `fit_history`), and the pairs left out."""
        head = [] if self.system is None else [{"role": "system", "content": self.system}]
        ctx = self.run.model.context_length
        room = reply_room(self.config, ctx)
        _, ids, dropped = fit_history(self.encoder, head, self.turns, user, room, ctx)
        return ids, dropped

    def reply(
        self,
        user: str,
        sink: TextSink | None = None,
        notify: Callable[[str], Any] = logger.warning,
    ) -> Sample:
        """Answer `user`: the reply's text goes to `sink` as it comes (under index 0), and the
        turn joins the history when the reply is whole (a Ctrl-C leaves both out).

        Raises:
            InputError: the text holds a chat token, or the tokenizer cannot encode it.
        """
        ids, dropped = self.prompt(user)
        ctx = self.run.model.context_length
        if dropped and not self.dropped:  # once: each turn after it leaves out more
            notify(
                f"the conversation no longer fits the context ({ctx} tokens): its oldest "
                f"{_pairs(dropped)} left out of the prompt, and from now on each reply reads "
                "only the latest exchanges that fit (/reset starts afresh)."
            )
        self.dropped = dropped
        ids = crop_chat_prompt(ids, ctx, notify)
        model, tokenizer = self.run.model, self.run.tokenizer
        job = SampleJob(0, 0, 0, user, ids, self.config.seed)
        with torch_threads(sample_threads(model, self.config, self.options.threads)):
            [sample] = sample_batch(model, tokenizer, [job], self.config, self.options, sink)
        self.turns += [
            {"role": "user", "content": user},
            {"role": "assistant", "content": sample.completion},
        ]
        return sample

    def reset(self) -> None:
        """Forget the turns; the system message stays."""
        self.turns, self.dropped = [], 0


def _pairs(n: int) -> str:
    return "exchange is" if n == 1 else f"{n} exchanges are"


def new_session(
    run: LoadedRun,
    config: SampleConfig,
    options: SampleOptions,
    system: str | None = None,
) -> ChatSession:
    """A session with `run`, whose reply stops at the chat tokens as well as `options`' ids.

    Raises:
        InputError: the run has no chat template (the message says how to make one), or its
            tokenizer lacks the chat tokens, or `system` holds one.
    """
    encoder = ConversationEncoder(require_run_template(run.run_dir), run.tokenizer)
    stops = (*options.stop_ids, *(i for i in reply_stop_ids(encoder) if i not in options.stop_ids))
    options = replace(options, stop_ids=stops)
    return ChatSession(
        run, encoder, config, options, None if system is None else check_system(system)
    )


def open_session(
    checkpoint: str | Path | None,
    system: str | None,
    overrides: dict[str, Any] | None = None,
    options: SampleOptions = SampleOptions(),
    notify: Callable[[str], Any] = logger.warning,
) -> ChatSession:
    """Load a run and start a conversation with it: what `llmcli chat` does before its first line.

    Args:
        checkpoint: a run directory (or a weights file in one); None = the latest chat run.
        system: the system message, or None.
        overrides: sampling settings by `SampleConfig` key, over the run's `sample:` config.
        options: stop strings, threads, which weights, the device (`num_samples` must be 1).
        notify: receives one-line notices (which run is used).

    Raises:
        InputError: see `new_session`; a bad setting, a missing run.
    """
    if options.num_samples != 1:
        raise InputError("chat gives one reply per message: leave out --num-samples.")
    if system is not None:
        check_system(system)  # before the run loads
    run, config, options = load_for_sampling(checkpoint, overrides, options, notify, "chat")
    return new_session(run, config, options, system)


# ----------------------------------------------------------------------------- a session's lines


def escape(text: str) -> str:
    """`text` on one line: backslashes, newlines, returns and tabs as `\\\\`, `\\n`, `\\r`,
    `\\t` (what `unescape` reads back)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


@dataclass
class _ReplySink:
    """Writes a reply's text as it comes, escaped onto one line with `one_line`."""

    write: Callable[[str], Any]
    one_line: bool
    last: str = "\n"

    def text(self, index: int, piece: str) -> None:
        piece = escape(piece) if self.one_line else piece
        if piece:
            self.last = piece[-1]  # first: Ctrl-C may land inside `write`
            self.write(piece)

    def end(self, index: int) -> None:
        pass

    def close(self) -> None:
        """End the reply's line: one line per reply with `one_line`."""
        if self.one_line or self.last != "\n":
            self.write("\n")


def session_command(session: ChatSession, line: str) -> tuple[str | None, bool]:
    """Run one `/command` line: the line to show (or None) and whether the session ends.

    Raises:
        InputError: an unknown command, or a setting's value its rule refuses.
    """
    if is_quit(line):
        return None, True
    name, _, raw = line[1:].strip().partition(" ")
    commands = ("reset", "system", "settings", "help", *SETTING_KEYS)
    key = complete_command(name.replace("-", "_"), commands)
    if key == "reset":
        session.reset()
        return "the conversation is forgotten" + (
            "; the system message stays" if session.system is not None else ""
        ), False
    if key == "system":
        session.system = check_system(unescape(raw.strip())) if raw.strip() else None
        return ("system message set" if session.system else "no system message"), False
    if key in ("help", "h", "?"):
        return HELP.format(keys=", ".join(SETTING_KEYS)), False
    if key == "settings":
        return format_settings(session.config), False
    if key not in SETTING_KEYS:
        commands = ("reset", "system", "quit", "settings", *SETTING_KEYS)
        hint = did_you_mean(f"/{key}", [f"/{c}" for c in commands], " Did you mean {}?")
        raise InputError(
            f"unknown command /{name}.{hint} The commands are /reset, /system TEXT, /quit, "
            "/settings, /KEY VALUE for a sampling setting; /help says more (a message starting "
            "with / is typed //)."
        )
    session.config, message = apply_command(
        session.config, f"/{key} {raw}", session.run.model.context_length
    )
    return message, False


def respond(
    session: ChatSession,
    text: str,
    write: Callable[[str], Any],
    notify: Callable[[str], Any] = logger.warning,
    one_line: bool = False,
) -> Sample | None:
    """Write the reply to `text` and end its line; None when Ctrl-C stopped it.

    Raises:
        InputError: see `ChatSession.reply` (nothing is written: the line gets no reply).
    """
    sink = _ReplySink(write, one_line)
    try:
        sample = session.reply(text, sink, notify)
    except KeyboardInterrupt:
        sink.close()
        notify("stopped (Ctrl-C): the reply is left out of the conversation; the next message?")
        return None
    sink.close()
    return sample


def chat(
    session: ChatSession,
    read_line: Callable[[], str | None],
    write: Callable[[str], Any],
    notify: Callable[[str], Any] = logger.warning,
    one_line: bool = False,
) -> int:
    """Reply to the lines `read_line` returns until it returns None (the end of the input) or
    `/quit`.

    Args:
        session: the conversation (`open_session`).
        read_line: the next line without its newline, or None at the end of the input; it
            raises `InputError` for a line that is not text.
        write: receives the replies' text as it is generated.
        notify: receives the commands' answers, notices and errors.
        one_line: write each reply as one line (see `escape`), else as it is.

    Returns:
        The number of messages replied to (to the end or stopped).
    """
    replied = 0
    while True:
        # A line that cannot be read or answered gets its reason, and the next line its turn:
        # one bad line in a piped script must not leave the rest unanswered.
        try:
            if (line := read_line()) is None or is_quit(line):
                return replied
            if line.startswith("/") and not line.startswith("//"):
                message, done = session_command(session, line)
                if message:
                    notify(message)
                if done:
                    return replied
            elif line.strip():
                respond(session, unescape(line.removeprefix("/")), write, notify, one_line)
                replied += 1
        except InputError as exc:
            notify(f"error: {exc}")
        except KeyboardInterrupt:
            notify(CTRL_C_AT_PROMPT)
