"""The chat template: how a conversation becomes the text a model reads, in one Jinja file.

A chat run holds one template, `chat_template.jinja` in its run directory, in Hugging Face's
`chat_template` format: it renders `messages` (a list of `{"role", "content"}`) and, with
`add_generation_prompt`, ends where the assistant's reply begins. Everything that turns messages
into ids reads it: training data (`llmcli.data.conversations`), `llmcli chat`, the server's
`/v1/chat/completions`, and the Hugging Face and GGUF exports, which copy it, so that
`transformers`' `apply_chat_template` gives the ids llmcli trained on.

The built-in template marks each turn with a role token and ends it with `<|end|>`:

    <|system|>\\nBe brief.<|end|>\\n<|user|>\\nHello<|end|>\\n<|assistant|>\\nHi!<|end|>\\n

The assistant's text and its `<|end|>` sit inside `{% generation %}`, the tag Hugging Face uses
for `return_assistant_tokens_mask`: what a model learns to write, and the only tokens with loss.
The template is rendered as `transformers` renders it: a sandboxed Jinja environment with
`trim_blocks` and `lstrip_blocks`, `raise_exception`, and the `generation` tag recording the
character spans it encloses.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli.errors import InputError
from llmcli.fileio import atomic_write_text

TEMPLATE_FILE = "chat_template.jinja"
ROLES = ("system", "user", "assistant")
# The tokens a chat run adds to its tokenizer: one per role, then the end of a turn.
ROLE_TOKENS = {role: f"<|{role}|>" for role in ROLES}
END_OF_TURN = "<|end|>"
CHAT_TOKENS = (*ROLE_TOKENS.values(), END_OF_TURN)

DEFAULT_TEMPLATE = """\
{%- for message in messages %}
{%- if message['role'] == 'assistant' %}
{{- '<|assistant|>\\n' }}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}\
{{- '\\n' }}
{%- else %}
{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|assistant|>\\n' }}
{%- endif %}
"""

# The spans of the text rendered inside {% generation %}, while a render records them.
_spans: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
    "chat_template_spans", default=None
)


def _environment() -> Any:
    """A sandboxed Jinja environment set up as `transformers` sets up its own for templates."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: records where its text lands."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            call = self.call_method("_record")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _record(self, caller: Any) -> str:
            text = caller()
            if (tracking := _spans.get()) is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.globals["raise_exception"] = raise_exception
    return env


@contextmanager
def _recording() -> Iterator[tuple[list[str], list[tuple[int, int]]]]:
    tracking: tuple[list[str], list[tuple[int, int]]] = ([], [])
    token = _spans.set(tracking)
    try:
        yield tracking
    finally:
        _spans.reset(token)


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation: its text and the `(start, end)` character spans of the parts a
    model writes (the assistant's turns, each with its end-of-turn token)."""

    text: str
    spans: tuple[tuple[int, int], ...]


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja text.
        origin: where it came from, for messages (a file's path, or "the built-in template").

    Raises:
        InputError: the text is not a valid Jinja template.
    """

    def __init__(self, source: str, origin: str = "the built-in chat template") -> None:
        import jinja2

        self.source, self.origin = source, origin
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise InputError(
                f"{origin} is not a valid Jinja template ({_describe(exc)}): fix it, or leave "
                "data.chat_template unset for the built-in one."
            ) from None

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> Rendered:
        """The text of `messages` (and with `add_generation_prompt`, the start of a reply).

        Raises:
            InputError: the template fails on these messages (a `raise_exception`, an error in
                its code) or renders nothing.
        """
        import jinja2

        with _recording() as (blocks, spans):
            try:
                for block in self._template.generate(
                    messages=list(messages), add_generation_prompt=add_generation_prompt
                ):
                    blocks.append(block)
            except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
                raise InputError(
                    f"{self.origin} does not render these messages ({_describe(exc)}): fix the "
                    "template or the messages."
                ) from None
        text = "".join(blocks)
        if not text:
            raise InputError(f"{self.origin} renders these messages as empty text: fix it.")
        return Rendered(text, tuple(spans))

    def save(self, run_dir: str | Path) -> None:
        """Write the template into a run directory (`chat_template.jinja`)."""
        atomic_write_text(Path(run_dir) / TEMPLATE_FILE, self.source)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChatTemplate) and other.source == self.source

    def __hash__(self) -> int:
        return hash(self.source)


def _describe(exc: Exception) -> str:
    line = getattr(exc, "lineno", None)
    where = f"line {line}: " if line else ""
    return f"{where}{type(exc).__name__}: {exc}"


def default_template() -> ChatTemplate:
    return ChatTemplate(DEFAULT_TEMPLATE)


def template_from_file(path: str | Path, what: str = "data.chat_template") -> ChatTemplate:
    """The template in a `.jinja` file (a config's `data.chat_template`).

    Raises:
        InputError: the file is missing or unreadable, or not a valid template.
    """
    path = Path(path).expanduser()
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise InputError(f"{what}: cannot read {str(path)!r} ({reason}).") from None
    return ChatTemplate(source, origin=f"{what} ({path})")


def chat_template(path: str | None) -> ChatTemplate:
    """`data.chat_template`'s template: a file's, or the built-in one for None."""
    return default_template() if path is None else template_from_file(path)


def load_run_template(run_dir: str | Path) -> ChatTemplate | None:
    """The template a run holds, or None when it has none (a run trained on plain text).

    Raises:
        InputError: the run's `chat_template.jinja` is unreadable or not a valid template.
    """
    path = Path(run_dir) / TEMPLATE_FILE
    if not path.is_file():
        return None
    return template_from_file(path, what=f"the run's {TEMPLATE_FILE}")


def require_run_template(run_dir: str | Path) -> ChatTemplate:
    """The run's template, or an `InputError` that says how to make a run that has one."""
    template = load_run_template(run_dir)
    if template is None:
        raise InputError(
            f"the run {str(run_dir)!r} has no chat template ({TEMPLATE_FILE}): it was trained on "
            "plain text. Fine-tune it on conversations first, e.g. `llmcli train configs/chat.yaml "
            f"--set train.init_from={run_dir}` (data.format: chat), then chat with that run."
        )
    return template
