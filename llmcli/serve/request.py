"""A completions request body checked into a `CompletionRequest` (a chat one, a `ChatRequest`).

Plain Python (no FastAPI), so that every rule is reached without a server. A request's settings
are the run's `sample:` config with the request's fields applied, as `llmcli sample`'s options are,
except `seed`: an omitted seed is a fresh one per request (as OpenAI's), so that repeated requests
differ. A refusal is an `APIError` (`llmcli.serve.response`) naming the field at fault.
"""

from __future__ import annotations

import math
import reprlib
import secrets
import typing
from dataclasses import dataclass, replace
from typing import Any

from llmcli.config import SampleConfig
from llmcli.config.rules import is_int
from llmcli.config.sample import broken_rule
from llmcli.data.conversations import check_messages
from llmcli.errors import InputError
from llmcli.serve.response import APIError

MAX_STOPS = 4  # OpenAI's limit on stop strings
MAX_LOGPROBS = 5  # OpenAI's limit on the top log-probs of each token
MAX_SEED = 2**63 - 1  # the largest seed `SampleConfig` takes: a fresh seed is below it

# How messages quote a value the request sent: cut short, so that a 1 MB string or a list nested
# 900 deep gives a short message (and no RecursionError).
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxstring, _QUOTE.maxother, _QUOTE.maxlong = 3, 60, 60, 40


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server.

    Attributes:
        max_tokens: the most new tokens of one choice (`max_tokens`).
        max_rows: the most choices of one request (prompts x `n`); also the most rows the
            server generates as one batch.
        max_body_bytes: the largest request body.
    """

    max_tokens: int = 1024
    max_rows: int = 64
    max_body_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_rows", "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} ({value!r}) must be an integer >= 1")


@dataclass(frozen=True)
class CompletionRequest:
    """A checked `POST /v1/completions` body.

    Attributes:
        prompts: the prompt texts (one for a string `prompt`).
        config: the sampling settings: the run's `sample:` config with the request's
            `max_tokens`, `temperature`, `top_p`, `top_k` and `seed` applied.
        n: choices per prompt; choice `i * n + j` is the `j`-th of prompt `i` and draws from
            a generator seeded `config.seed + i * n + j`, as `llmcli sample --num-samples n`.
        stop: stop strings (not part of the text).
        stream: answer as server-sent events.
        include_usage: (stream) a last chunk holds the usage.
        logprobs: how many most likely tokens to list at each position (0: only the chosen
            token's log-prob), or None for no log-probs.
        echo: each choice's text starts with its prompt.
        stop_ids: token ids that end a choice besides the run's end-of-text (a chat reply's
            end-of-turn and role tokens); not part of the text.
    """

    prompts: list[str]
    config: SampleConfig
    n: int = 1
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    echo: bool = False
    stop_ids: tuple[int, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    def batch_key(self) -> tuple[Any, ...]:
        """What requests batched together must share: every setting but the seed, and the
        stop strings and ids."""
        return (replace(self.config, seed=0), self.stop, self.stop_ids)


# OpenAI fields that are accepted only at the value that means "off".
_OFF_VALUES = {
    "suffix": (None,),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}
# The request fields that set a `SampleConfig` setting, each checked by the setting's rule: OpenAI's
# names, and top_k (vLLM's and llama.cpp's). The run's config sets the others.
_HINTS = typing.get_type_hints(SampleConfig)
SAMPLE_FIELDS = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
}
# The settings a JSON number sets (float in `SampleConfig`); the others take integers.
_NUMBER_FIELDS = {
    name
    for name, key in SAMPLE_FIELDS.items()
    if float in (typing.get_args(_HINTS[key]) or (_HINTS[key],))
}
_FIELDS = {
    "model",
    "prompt",
    *SAMPLE_FIELDS,
    "n",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "echo",
    "best_of",
    "user",
    *_OFF_VALUES,
}


def parse_completion(
    body: Any, defaults: SampleConfig, limits: Limits, model_id: str
) -> CompletionRequest:
    """Check a `POST /v1/completions` body and turn it into a `CompletionRequest`.

    Args:
        body: the parsed JSON body.
        defaults: the run's `sample:` config (what an omitted setting is).
        limits: the server's limits.
        model_id: the served model's id; a request naming another model is refused (404).

    Raises:
        APIError: 400 for an unknown field, a wrong type or a value outside its range (the
            message names the field); 404 for another model.
    """
    _check_body(body, _FIELDS, _OFF_VALUES, model_id)
    prompts = _prompts(body.get("prompt"))
    n = _integer(body, "n", 1, low=1, high=limits.max_rows)
    if len(prompts) * n > limits.max_rows:
        raise APIError(
            400,
            f"{len(prompts)} prompts x n={n} is {len(prompts) * n} choices; this server "
            f"answers at most {limits.max_rows} per request: send fewer prompts or a smaller n.",
            param="n",
            code="invalid_value",
        )
    best_of = _integer(body, "best_of", n, low=1)
    if best_of != n:
        raise APIError(400, "best_of must equal n (or be left out).", param="best_of")
    stream = _boolean(body, "stream")
    return CompletionRequest(
        prompts=prompts,
        config=_sample_config(body, defaults, limits),
        n=n,
        stop=_stops(body.get("stop")),
        stream=stream,
        include_usage=_include_usage(body.get("stream_options"), stream),
        logprobs=_optional_integer(body, "logprobs", 0, MAX_LOGPROBS),
        echo=_boolean(body, "echo"),
    )


def _check_body(
    body: Any, fields: set[str], off_values: dict[str, tuple[Any, ...]], model_id: str
) -> None:
    """A JSON object of known `fields`, for the served model, its `off_values` fields off."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object.", code="invalid_type")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise APIError(
            400,
            f"unrecognized request argument supplied: {_QUOTE.repr(unknown[0])} (this server takes "
            f"{', '.join(sorted(fields - set(off_values)))}).",
            param=unknown[0],
            code="unknown_parameter",
        )
    _check_model(body.get("model"), model_id)
    _check_off_values(body, off_values)


def _check_model(model: Any, model_id: str) -> None:
    if model is None:
        return
    if not isinstance(model, str):
        raise APIError(400, "model must be a string.", param="model", code="invalid_type")
    if model != model_id:
        raise APIError(
            404,
            f"the model {_QUOTE.repr(model)} does not exist: this server serves {model_id!r} "
            "(GET /v1/models lists it).",
            param="model",
            code="model_not_found",
        )


def _check_off_values(body: dict[str, Any], off_values: dict[str, tuple[Any, ...]]) -> None:
    for name, off in off_values.items():
        if name in body and not any(_same(body[name], value) for value in off):
            raise APIError(
                400,
                f"{name} is not supported by this server: leave it out.",
                param=name,
                code="unsupported_parameter",
            )


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _prompts(prompt: Any) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt is None:
        raise APIError(
            400,
            "prompt is missing: send a string or a list of strings.",
            param="prompt",
            code="missing_required_parameter",
        )
    raise _type_error("prompt", prompt, "a string or a non-empty list of strings")


def _type_error(name: str, value: Any, wanted: str) -> APIError:
    return APIError(
        400,
        f"{name} must be {wanted}, not {_QUOTE.repr(value)} ({type(value).__name__}).",
        param=name,
        code="invalid_type",
    )


def _range_error(name: str, value: Any, rule: str) -> APIError:
    return APIError(400, f"{name} ({_QUOTE.repr(value)}) {rule}.", param=name, code="invalid_value")


def _integer(
    body: dict[str, Any], name: str, default: int, *, low: int, high: int | None = None
) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value):
        raise _type_error(name, value, "an integer")
    if value < low or (high is not None and value > high):
        rule = f"must be >= {low}" if high is None else f"must be in {low}..{high}"
        raise _range_error(name, value, rule)
    return value


def _optional_integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    return None if body.get(name) is None else _integer(body, name, low, low=low, high=high)


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    try:
        number = float(value) if isinstance(value, (int, float)) else math.nan
    except OverflowError:  # an integer past float's range, such as 10**400
        number = math.inf
    if isinstance(value, bool) or not math.isfinite(number):
        raise _type_error(name, value, "a finite number")
    return number


def _boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _type_error(name, value, "true or false")
    return value


def _sample_config(body: dict[str, Any], defaults: SampleConfig, limits: Limits) -> SampleConfig:
    """The run's settings with the request's, each checked by `SampleConfig`'s rule for it;
    omitted `max_tokens` is the run's, within the limit; omitted `seed` a fresh one."""
    settings: dict[str, Any] = {
        "max_new_tokens": min(defaults.max_new_tokens, limits.max_tokens),
        "seed": secrets.randbelow(MAX_SEED),
    }
    for name, key in SAMPLE_FIELDS.items():
        value = body.get(name)
        if value is None:
            if name == "top_k" and name in body:  # null keeps every token
                settings[key] = None
            continue
        if name in _NUMBER_FIELDS:
            value = _number(body, name)
        elif not is_int(value):
            raise _type_error(name, value, "an integer")
        rule = broken_rule(key, value)
        if rule is not None:
            raise _range_error(name, value, rule)
        settings[key] = value
    if settings["max_new_tokens"] > limits.max_tokens:
        raise APIError(
            400,
            f"max_tokens ({_QUOTE.repr(settings['max_new_tokens'])}) is more than this server "
            f"allows: at most {limits.max_tokens} new tokens per choice (`llmcli serve "
            "--max-tokens` sets it).",
            param="max_tokens",
            code="invalid_value",
        )
    return replace(defaults, **settings)


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _type_error("stop", stop, "a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise _range_error("stop", stop, f"may hold at most {MAX_STOPS} strings")
    return tuple(s for s in stops if s)


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise APIError(
            400, "stream_options is only allowed with stream: true.", param="stream_options"
        )
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise _type_error("stream_options", options, 'an object such as {"include_usage": true}')
    return _boolean(options, "include_usage")


# ----------------------------------------------------------------------------- chat completions


@dataclass(frozen=True)
class ChatRequest:
    """A checked `POST /v1/chat/completions` body.

    Attributes:
        messages: the conversation to answer (checked by `check_messages`: an optional system
            message, then user and assistant turns, ending with the user's).
        config: the sampling settings, as a `CompletionRequest`'s (`max_completion_tokens` is
            another name for `max_tokens`).
        n: choices; choice `j` draws from a generator seeded `config.seed + j`.
        stop: stop strings (not part of the text).
        stream: answer as server-sent events.
        include_usage: (stream) a last chunk holds the usage.
    """

    messages: list[dict[str, str]]
    config: SampleConfig
    n: int = 1
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False

    def completion(self, prompt: str, stop_ids: tuple[int, ...]) -> CompletionRequest:
        """The completion the batcher runs: the rendered conversation, ending its choices at
        `stop_ids` too."""
        return CompletionRequest(
            prompts=[prompt],
            config=self.config,
            n=self.n,
            stop=self.stop,
            stream=self.stream,
            include_usage=self.include_usage,
            stop_ids=stop_ids,
        )


# Chat fields accepted only at the value that means "off" (log-probs and tools are not served).
_CHAT_OFF_VALUES = {
    **{name: off for name, off in _OFF_VALUES.items() if name != "suffix"},
    "logprobs": (None, False),
    "top_logprobs": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
}
_CHAT_FIELDS = {
    "model",
    "messages",
    *SAMPLE_FIELDS,
    "max_completion_tokens",
    "n",
    "stop",
    "stream",
    "stream_options",
    "user",
    *_CHAT_OFF_VALUES,
}


def parse_chat_completion(
    body: Any, defaults: SampleConfig, limits: Limits, model_id: str
) -> ChatRequest:
    """Check a `POST /v1/chat/completions` body and turn it into a `ChatRequest`.

    Args:
        body, defaults, limits, model_id: see `parse_completion`.

    Raises:
        APIError: 400 for an unknown field, a wrong type, a value outside its range, or
            messages that are not a conversation to answer (an unknown role, roles out of
            order, a last message that is not the user's); 404 for another model.
    """
    _check_body(body, _CHAT_FIELDS, _CHAT_OFF_VALUES, model_id)
    messages = _messages(body.get("messages"))
    stream = _boolean(body, "stream")
    return ChatRequest(
        messages=messages,
        config=_sample_config(_max_tokens(body), defaults, limits),
        n=_integer(body, "n", 1, low=1, high=limits.max_rows),
        stop=_stops(body.get("stop")),
        stream=stream,
        include_usage=_include_usage(body.get("stream_options"), stream),
    )


def _max_tokens(body: dict[str, Any]) -> dict[str, Any]:
    """The body with `max_completion_tokens` (OpenAI's newer name) as `max_tokens`."""
    value = body.get("max_completion_tokens")
    if value is None:
        return body
    if not is_int(value):
        raise _type_error("max_completion_tokens", value, "an integer")
    if body.get("max_tokens") is not None and not _same(body["max_tokens"], value):
        raise APIError(
            400,
            "max_tokens and max_completion_tokens differ: send one of them.",
            param="max_completion_tokens",
            code="invalid_value",
        )
    return {**body, "max_tokens": value}


def _messages(messages: Any) -> list[dict[str, str]]:
    if messages is None:
        raise APIError(
            400,
            "messages is missing: send a list of {role, content} ending with the user's turn.",
            param="messages",
            code="missing_required_parameter",
        )
    try:
        return check_messages(messages, "messages", complete=False)
    except InputError as exc:
        raise APIError(400, str(exc), param="messages", code="invalid_value") from None
