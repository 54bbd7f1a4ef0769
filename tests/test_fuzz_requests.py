"""Request fuzzing: whatever body a client sends `llmcli serve`, the answer is below 500, and a
refusal is OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`).

Hypothesis builds bodies from the completions fields with random JSON values (integers past any
range, NaN, lone surrogates, lists for numbers, nested values), JSON that is not an object, and
random or cut bytes. Two levels: the request's checks (`parse_completion`, `request_prompt_ids`,
`error_response`), many examples and no server, on a char and a BPE run; and fewer whole HTTP
requests through the app (Starlette's test client), on a tiny model allowed 3 new tokens.
`test_serve.py` pins the bodies once answered with a 500, one by one. Chat completions get the
same two levels, with bodies built from conversations of any roles, contents and lengths, on
chat runs (the built-in template, the chat tokens added).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from conftest import save_tiny_run
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmcli.data.chat_template import default_template
from llmcli.data.conversations import add_chat_tokens
from llmcli.data.tokenizer import BPETokenizer, CharTokenizer
from llmcli.runs.loading import LoadedRun, load_run
from llmcli.serve.answer import error_response
from llmcli.serve.app import ServeSettings, create_app
from llmcli.serve.encoding import ChatEncoding, request_prompt_ids
from llmcli.serve.request import Limits, parse_chat_completion, parse_completion
from llmcli.serve.response import APIError

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

# Derandomized, as test_fuzz_readers.py's: every run tries the same examples.
FUZZ = settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TEXT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me!\n"
LIMITS = Limits(max_tokens=3, max_rows=4)  # few tokens per answer; the default 1 MiB body
# OpenAI's completions fields (and top_k): the ones a body is most often made of.
FIELDS = [
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop",
    "stream", "stream_options", "logprobs", "echo", "best_of", "user", "suffix",
    "presence_penalty", "frequency_penalty", "logit_bias",
]  # fmt: skip

# Characters of the vocabulary, and ones no vocabulary holds: lone surrogates.
CHARS = st.sampled_from([*sorted(set(TEXT)), "\ud800", "\udcff", "é", "\x00"]) | st.characters()
STRINGS = st.text(CHARS, max_size=10) | st.sampled_from(["", "ROMEO:", "tiny", "a" * 40])
# Values that once met code that did not expect them: past float's or int64's range, not finite,
# not text.
ODD = st.sampled_from([2**63, 10**400, -(10**400), 1e308, math.nan, math.inf, "\ud800", "\udcff"])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([0, 1, 2, 3, 5, -1, 1.0, 0.5])
    | st.floats(allow_nan=True, allow_infinity=True)
    | STRINGS
    | ODD
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(STRINGS, inner, max_size=3),
    max_leaves=6,
)
# A request close to a good one (so that examples get past the first checks), with random fields.
GOOD = st.fixed_dictionaries(
    {"prompt": st.sampled_from(["ROMEO:", "a", "", ["a", "JULIET"]]) | STRINGS},
    optional={
        "max_tokens": st.integers(1, 3),
        "n": st.integers(1, 2),
        "stream": st.booleans(),
        "echo": st.booleans(),
        "logprobs": st.none() | st.integers(0, 5),
        "stop": st.sampled_from(["e", ["a", ""]]),
    },
)
BODIES = st.builds(
    lambda good, fields: {**good, **fields},
    GOOD,
    st.dictionaries(st.sampled_from([*FIELDS, "temprature", "", "\ud800"]), VALUES, max_size=2),
)
REQUESTS = BODIES | VALUES  # a body may be any JSON value: an object with any keys, a list...


def raw(value: Any) -> bytes:
    """A value as a client sends it: NaN as a literal, a lone surrogate as its JSON escape."""
    return json.dumps(value).encode()


# What a client may send: such JSON, that JSON cut short or with a byte changed, random bytes.
PAYLOADS = (
    BODIES.map(raw)
    | REQUESTS.map(raw)
    | st.builds(lambda data, at: data[:at], REQUESTS.map(raw), st.integers(0, 60))
    | st.builds(
        lambda data, at, byte: data[:at] + byte + data[at + 1 :],
        BODIES.map(raw),
        st.integers(0, 60),
        st.binary(min_size=1, max_size=1),
    )
    | st.binary(max_size=40)
)


def check_error(status: int, body: bytes) -> None:
    """A refusal: a 4xx with OpenAI's error JSON."""
    assert 400 <= status < 500, body
    reply = json.loads(body)
    assert set(reply) == {"error"}
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)


@pytest.fixture(scope="module", params=["char", "bpe"])
def run(request, tmp_path_factory) -> LoadedRun:
    raw_config = {
        "model": {"n_layer": 1, "n_head": 1, "n_embed": 8, "context_length": 16},
        "sample": {"max_new_tokens": 3, "temperature": 1.0, "top_k": 10, "seed": 3},
    }
    if request.param == "char":
        tokenizer = CharTokenizer.train([TEXT])
    else:
        tokenizer = BPETokenizer.train([TEXT] * 4, vocab_size=280)
    folder = tmp_path_factory.mktemp("runs") / request.param
    return load_run(save_tiny_run(folder, tokenizer, raw_config))


@FUZZ
@given(body=REQUESTS)
@example(body={"prompt": "a", "temperature": 10**400})
@example(body={"\ud800": 1})
def test_every_body_is_a_request_or_a_4xx_error(run, body) -> None:
    try:
        request = parse_completion(body, run.config.sample, LIMITS, "tiny")
        ids = request_prompt_ids(run, request.prompts)
    except APIError as exc:
        check_error(exc.status, error_response(exc).body)
        return
    assert 1 <= request.rows <= LIMITS.max_rows and len(ids) == len(request.prompts)
    assert 1 <= request.config.max_new_tokens <= LIMITS.max_tokens


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> TestClient:
    raw_config = {
        "model": {"n_layer": 1, "n_head": 1, "n_embed": 8, "context_length": 16},
        "sample": {"max_new_tokens": 3},
    }
    folder = Path(tmp_path_factory.mktemp("runs")) / "tiny"
    run = load_run(save_tiny_run(folder, CharTokenizer.train([TEXT]), raw_config))
    app = create_app(run, ServeSettings(limits=LIMITS, batch_wait_ms=0))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@settings(FUZZ, max_examples=150)
@given(payload=PAYLOADS, content_type=st.sampled_from(["application/json", "text/plain", ""]))
@example(payload=b"[" * 100_000 + b"]" * 100_000, content_type="application/json")
@example(payload=b'{"prompt": "a", "top_p": 1' + b"0" * 400 + b"}", content_type="")
@example(payload=b'{"\\ud800": 1}', content_type="application/json")
def test_every_http_request_is_answered_below_500(client, payload, content_type) -> None:
    response = client.post(
        "/v1/completions", content=payload, headers={"content-type": content_type}
    )
    if response.status_code >= 400:
        check_error(response.status_code, response.content)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        assert all("error" not in json.loads(e.removeprefix("data: ")) for e in events[:-1])
    else:
        assert response.status_code == 200 and response.json()["choices"]


# ----------------------------------------------------------------------------- chat completions

CHAT_FIELDS = [
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "seed", "n", "stop", "stream", "stream_options", "user", "logprobs", "top_logprobs", "tools",
    "tool_choice", "presence_penalty", "logit_bias", "prompt",
]  # fmt: skip
ROLES = st.sampled_from(["system", "user", "assistant", "bot", "", "USER"]) | VALUES
CONTENTS = STRINGS | st.sampled_from(["<|end|>", "a<|user|>", "Hello", "a" * 20]) | VALUES
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES, "content": CONTENTS}, optional={"name": STRINGS, "extra": VALUES}
)
# Conversations in order (the checks pass) and in any order, of any length (past the context).
TURNS = st.lists(st.tuples(STRINGS, STRINGS), max_size=3).map(
    lambda pairs: [
        {"role": role, "content": text}
        for user, reply in pairs
        for role, text in (("user", user), ("assistant", reply))
    ]
)
CONVERSATIONS = st.builds(
    lambda system, turns, last: [*system, *turns, {"role": "user", "content": last}],
    st.lists(st.builds(lambda text: {"role": "system", "content": text}, STRINGS), max_size=1),
    TURNS,
    STRINGS,
)
CHAT_GOOD = st.fixed_dictionaries(
    {"messages": CONVERSATIONS | st.lists(MESSAGE | VALUES, max_size=4)},
    optional={
        "max_tokens": st.integers(1, 3),
        "n": st.integers(1, 2),
        "stream": st.booleans(),
        "stop": st.sampled_from(["e", ["a", ""]]),
    },
)
CHAT_BODIES = st.builds(
    lambda good, fields: {**good, **fields},
    CHAT_GOOD,
    st.dictionaries(st.sampled_from([*CHAT_FIELDS, "mesages"]), VALUES, max_size=2),
)
CHAT_REQUESTS = CHAT_BODIES | VALUES
CHAT_PAYLOADS = (
    CHAT_BODIES.map(raw)
    | st.builds(lambda data, at: data[:at], CHAT_BODIES.map(raw), st.integers(0, 60))
    | st.builds(
        lambda data, at, byte: data[:at] + byte + data[at + 1 :],
        CHAT_BODIES.map(raw),
        st.integers(0, 60),
        st.binary(min_size=1, max_size=1),
    )
)


def chat_run(folder: Path, tokenizer) -> LoadedRun:
    raw_config = {
        "model": {"n_layer": 1, "n_head": 1, "n_embed": 8, "context_length": 32},
        "sample": {"max_new_tokens": 3, "temperature": 1.0, "top_k": 10, "seed": 3},
        "data": {"format": "chat"},
    }
    save_tiny_run(folder, add_chat_tokens(tokenizer), raw_config)
    default_template().save(folder)
    return load_run(folder)


@pytest.fixture(scope="module", params=["char", "bpe"])
def chat(request, tmp_path_factory) -> tuple[LoadedRun, ChatEncoding]:
    if request.param == "char":
        tokenizer = CharTokenizer.train([TEXT])
    else:
        tokenizer = BPETokenizer.train([TEXT] * 4, vocab_size=280)
    run = chat_run(tmp_path_factory.mktemp("runs") / f"chat-{request.param}", tokenizer)
    return run, ChatEncoding(run)


@FUZZ
@given(body=CHAT_REQUESTS)
@example(body={"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 10**400})
@example(body={"messages": [{"role": "user", "content": "\ud800"}]})
def test_every_chat_body_is_a_request_or_a_4xx_error(chat, body) -> None:
    run, encoding = chat
    try:
        request = parse_chat_completion(body, run.config.sample, LIMITS, "tiny")
        encoder, stop_ids = encoding.encoder()
        _, ids = encoding.encode(encoder, request)
    except APIError as exc:
        check_error(exc.status, error_response(exc).body)
        return
    assert request.messages[-1]["role"] == "user" and 1 <= request.n <= LIMITS.max_rows
    assert 1 <= len(ids) <= run.model.context_length and encoder.end_id in stop_ids
    assert 1 <= request.config.max_new_tokens <= LIMITS.max_tokens


@pytest.fixture(scope="module")
def chat_client(tmp_path_factory) -> TestClient:
    run = chat_run(tmp_path_factory.mktemp("runs") / "chat", CharTokenizer.train([TEXT]))
    app = create_app(run, ServeSettings(limits=LIMITS, batch_wait_ms=0))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@settings(FUZZ, max_examples=100)
@given(payload=CHAT_PAYLOADS | REQUESTS.map(raw) | st.binary(max_size=40))
@example(payload=b'{"messages": [{"role": "user", "content": "a"}], "stream": true, "n": 2}')
def test_every_chat_request_is_answered_below_500(chat_client, payload) -> None:
    response = chat_client.post(
        "/v1/chat/completions", content=payload, headers={"content-type": "application/json"}
    )
    if response.status_code >= 400:
        check_error(response.status_code, response.content)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    else:
        reply = response.json()
        assert response.status_code == 200 and reply["object"] == "chat.completion"
        assert all(c["message"]["role"] == "assistant" for c in reply["choices"])
