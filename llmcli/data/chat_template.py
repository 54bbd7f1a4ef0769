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

A template renders here as `transformers` 5 renders it in `apply_chat_template`, so that one
written for the Hub gives the text it gives there:

- the environment: Jinja's `ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks`,
  the `loopcontrols` extension (`{% break %}`, `{% continue %}`) and the `generation` tag;
- the filter `tojson` is `transformers`' own, `json.dumps(value, ensure_ascii=False,
  indent=None, separators=None, sort_keys=False)` with those four as its options: non-ASCII
  text kept, keys in their order, and none of Jinja's HTML escapes (its `tojson` writes `<`,
  `>`, `&` and `'` as `\\u003c`..., and sorts keys);
- the globals `raise_exception(message)`, `strftime_now(format)` (the local time now),
  `dict(...)`, and `namespace(...)`, which refuses attribute names that start with `_`;
- the variables `messages`, `tools` (a list of JSON schemas, or none), `documents` (a list of
  objects, or none), `add_generation_prompt`, the tokenizer's named special tokens
  (`bos_token` and `eos_token`, the end-of-text token, as the Hugging Face export declares them:
  `llmcli.data.tokenizer.special_tokens`) and any other keyword given to `render`. Each is
  rebuilt from plain JSON types (anything else becomes a placeholder such as `"<ndarray>"`), the
  keys of a message whose value is None are left out, and a message's reasoning (under
  `reasoning_content`, `thinking` or `reasoning`) is given as `reasoning_content` and, unless it
  has one, `thinking`.

What a model writes in a training conversation (`ChatTemplate.render_training`, which the loss
mask of `llmcli.data.conversations` marks): the spans inside `{% generation %}` when the
template has the tag. Most templates on the Hub do not, and `transformers` then marks nothing;
llmcli takes the prefix rule instead: assistant turn i writes what `render(messages[:i + 1])`
adds to `render(messages[:i], add_generation_prompt=True)`, its text, its end-of-turn token and
whatever the template writes after that before the next turn (ChatML's newline). The rule needs
each of those texts to start with the one before it, and the whole conversation's text to start
with each: a template that renders a turn differently once later turns follow (one that drops
earlier turns' reasoning, as Qwen3's does) is refused with an `InputError` that asks for
`{% generation %}` around the assistant's text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
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
# The names a message's reasoning goes by; templates read the first (and gpt-oss's `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """`transformers`' `tojson`: Jinja's own escapes `<`, `>`, `&` and `'` for HTML and sorts
    keys, which would change the text of every tool schema a model was trained on."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    """The local time now, as `format` writes it (Llama 3.2's template dates its system turn)."""
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, with no other way into the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


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

    class Namespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses names starting with `_`, the way into Python's
        internals that the sandbox would otherwise have to guard."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature: `self` may be a key
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a namespace cannot hold the attribute {name!r} (it starts with '_')"
            )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=Namespace,
    )
    return env


def _marks_generation(tree: Any) -> bool:
    """Whether a parsed template holds a `{% generation %}` block (a call of its `_record`)."""
    import jinja2

    return any(
        isinstance(block.call.node, jinja2.nodes.ExtensionAttribute)
        and block.call.node.name == "_record"
        for block in tree.find_all(jinja2.nodes.CallBlock)
    )


@contextmanager
def _recording() -> Iterator[tuple[list[str], list[tuple[int, int]]]]:
    tracking: tuple[list[str], list[tuple[int, int]]] = ([], [])
    token = _spans.set(tracking)
    try:
        yield tracking
    finally:
        _spans.reset(token)


# --- What a template sees ---------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """`value` rebuilt from JSON's types, anything else as a placeholder (`"<ndarray>"`), as
    `transformers` hands data to a template: the sandbox does not know which methods of other
    objects are safe to call."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # A subclass (an enum, a numpy float) back to its base type, without its own methods.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"


def _template_messages(messages: Sequence[Any], origin: str) -> list[dict]:
    """The messages as `transformers` gives them to a template: plain data, without the keys
    whose value is None (a template tests whether a key is there), and the reasoning under the
    names templates read."""
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InputError(f"{origin}: message {i} is not an object ({type(message).__name__}).")
        message = {_plain(k): _plain(v) for k, v in message.items() if v is not None}
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        plain.append(message)
    return plain


def _objects(items: Sequence[Any] | None, what: str, origin: str) -> list | None:
    """`tools` or `documents`: None, or a list of objects (a tool is its JSON schema)."""
    if items is None:
        return None
    if not all(isinstance(item, Mapping) for item in items):
        raise InputError(f"{origin}: each of the {what} must be an object (a JSON schema).")
    return _plain(list(items))


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
            env = _environment()
            tree = env.parse(source)
            self._template = env.from_string(tree)
        except jinja2.TemplateError as exc:
            raise InputError(
                f"{origin} is not a valid Jinja template ({_describe(exc)}): fix it, or leave "
                "data.chat_template unset for the built-in one."
            ) from None
        self.marks_generation = _marks_generation(tree)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> Rendered:
        """The text of `messages` (and with `add_generation_prompt`, the start of a reply), with
        the spans inside `{% generation %}`, as `apply_chat_template` renders them.

        Args:
            messages: the conversation, `[{"role", "content", ...}, ...]`.
            add_generation_prompt: end where the assistant's reply begins.
            tools: the tools' JSON schemas, for a template that writes them.
            documents: objects for retrieval, for a template that writes them.
            variables: more of what the template reads: the tokenizer's special tokens
                (`bos_token`, ...) and a template's own options (Llama's `date_string`).

        Raises:
            InputError: the template fails on these messages (a `raise_exception`, an error in
                its code) or renders nothing.
        """
        import jinja2

        context = {
            "messages": _template_messages(messages, self.origin),
            "tools": _objects(tools, "tools", self.origin),
            "documents": _objects(documents, "documents", self.origin),
            "add_generation_prompt": add_generation_prompt,
            **_plain(variables),
        }
        with _recording() as (blocks, spans):
            try:
                for block in self._template.generate(**context):
                    blocks.append(block)
            # A template is the user's code: what it raises is an error in the input.
            except (
                jinja2.TemplateError,
                TypeError,
                ValueError,
                LookupError,
                ArithmeticError,
                AttributeError,
            ) as exc:
                raise InputError(
                    f"{self.origin} does not render these messages ({_describe(exc)}): fix the "
                    "template or the messages."
                ) from None
        text = "".join(blocks)
        if not text:
            raise InputError(f"{self.origin} renders these messages as empty text: fix it.")
        return Rendered(text, tuple(spans))

    def render_training(self, messages: Sequence[Mapping[str, Any]], **context: Any) -> Rendered:
        """A training conversation's text, with the spans of what a model writes: those inside
        `{% generation %}`, or for a template without the tag, by the prefix rule (the module's
        docstring): each assistant turn's text after the generation prompt before it.

        Args:
            messages: the conversation.
            context: `render`'s keywords (`tools`, `documents`, special tokens, ...).

        Raises:
            InputError: the template fails on the messages, or has no `{% generation %}` and
                renders a turn differently once later turns follow.
        """
        whole = self.render(messages, False, **context)
        if self.marks_generation:
            return whole
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], True, **context).text
            through = self.render(messages[: i + 1], False, **context).text
            if not (through.startswith(before) and whole.text.startswith(through)):
                raise InputError(
                    f"{self.origin} has no {{% generation %}} tags, and llmcli cannot tell which "
                    f"tokens of message {i} (the assistant's) the model writes: its text for "
                    f"messages[:{i + 1}] does not start with its text for messages[:{i}] with "
                    "add_generation_prompt, or the whole conversation's text does not start "
                    "with it (the template renders a turn differently depending on what follows "
                    "it). Put {% generation %}...{% endgeneration %} around what the assistant "
                    "writes in the template."
                )
            spans.append((len(before), len(through)))
        return Rendered(whole.text, tuple(spans))

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
            "plain text. Fine-tune it on conversations first, e.g. `llmcli train chat --set "
            f"train.init_from={run_dir}` (the shipped chat config, data.format: chat), then chat "
            "with that run."
        )
    return template
