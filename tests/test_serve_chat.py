"""`POST /v1/chat/completions` through the real `openai` client, streamed and not, against
`llmcli chat`'s replies to the same conversation; usage against the template's ids; errors as
OpenAI's error JSON."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import httpx
import openai
import pytest
from chat_helpers import save_chat_run
from conftest import save_tiny_run
from fastapi.testclient import TestClient
from test_serve import running

from llmcli.cli import main
from llmcli.data.chat_template import default_template
from llmcli.data.conversations import ConversationEncoder
from llmcli.data.tokenizer import CharTokenizer
from llmcli.generation.prompts import unescape
from llmcli.runs.loading import load_run
from llmcli.serve.app import ServeSettings, create_app
from llmcli.serve.request import Limits

pytestmark = pytest.mark.usefixtures("one_thread")

# The model test_chat_cli.py uses: its greedy reply to "Hello" ends with <|end|> (13 characters
# and the end token), its reply to "Spell cat." runs to the limit.
MODEL_SEED = 6
LIMITS = Limits(max_tokens=64, max_rows=8, max_body_bytes=8192)
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return save_chat_run(tmp_path_factory.mktemp("runs") / "chat", seed=MODEL_SEED, sharpen=8.0)


@pytest.fixture(scope="module")
def url(run_dir):
    app = create_app(load_run(run_dir), ServeSettings(limits=LIMITS, batch_wait_ms=2))
    with running(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def chat_replies(capsys, monkeypatch, run_dir, lines, *options: str) -> list[str]:
    """`llmcli chat`'s replies to `lines` (one message each), piped in."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    with pytest.raises(SystemExit) as exc:
        main(["chat", "--checkpoint", str(run_dir), *options])
    out = capsys.readouterr()
    assert exc.value.code == 0, out.err
    return [unescape(line) for line in out.out.splitlines()]


def streamed(client, messages, **kwargs) -> tuple[dict[int, str], dict[int, str], list]:
    """A streamed chat completion: each choice's text and finish reason, and the chunks."""
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


def test_greedy_replies_equal_llmcli_chat_streamed_and_not(
    run_dir, client, capsys, monkeypatch
) -> None:
    first, second = chat_replies(
        capsys, monkeypatch, run_dir, ["Hello", "Spell cat."], "--temperature", "0",
        "--max-new-tokens", "20",
    )  # fmt: skip
    conversation = [
        *HELLO,
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Spell cat."},
    ]
    encoder = ConversationEncoder(default_template(), load_run(run_dir).tokenizer)
    for messages, reply, finish, new_tokens in [
        (HELLO, first, "stop", len(first) + 1),  # char tokens, and the <|end|> that ended it
        (conversation, second, "length", 20),
    ]:
        whole = client.chat.completions.create(
            model="chat", messages=messages, temperature=0, max_tokens=20
        )
        [choice] = whole.choices
        assert (choice.message.role, choice.message.content) == ("assistant", reply)
        assert choice.finish_reason == finish and whole.object == "chat.completion"
        assert whole.usage.prompt_tokens == len(encoder.prompt(messages))
        assert whole.usage.completion_tokens == new_tokens
        assert whole.usage.total_tokens == whole.usage.prompt_tokens + new_tokens
        texts, reasons, chunks = streamed(
            client, messages, model="chat", temperature=0, max_tokens=20,
            stream_options={"include_usage": True},
        )  # fmt: skip
        assert texts == {0: reply} and reasons == {0: finish}
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_n_choices_draw_from_seed_plus_index(run_dir, client, capsys, monkeypatch) -> None:
    settings = {"temperature": 1.0, "max_tokens": 12, "extra_body": {"top_k": 1000}}
    whole = client.chat.completions.create(model="chat", messages=HELLO, n=3, seed=5, **settings)
    texts = [c.message.content for c in whole.choices]
    alone = [
        chat_replies(
            capsys, monkeypatch, run_dir, ["Hello"], "--temperature", "1.0", "--top-k", "1000",
            "--max-new-tokens", "12", "--seed", str(5 + j),
        )[0]
        for j in range(3)
    ]  # fmt: skip
    assert texts == alone and len(set(texts)) > 1
    assert [c.index for c in whole.choices] == [0, 1, 2]
    stream_texts, _, _ = streamed(client, HELLO, model="chat", n=3, seed=5, **settings)
    assert stream_texts == dict(enumerate(texts))


def test_stop_strings_and_max_tokens(run_dir, client, capsys, monkeypatch) -> None:
    [greedy] = chat_replies(
        capsys, monkeypatch, run_dir, ["Hello"], "--temperature", "0", "--max-new-tokens", "20"
    )
    assert greedy == ",qqq\nYVVVVH.Z"  # the fixture's model: what the cases below cut
    [cut] = chat_replies(
        capsys, monkeypatch, run_dir, ["Hello"], "--temperature", "0", "--stop", "VH"
    )
    for kwargs, text, finish in [
        ({"stop": ["VH", "zz"]}, cut, "stop"),
        ({"max_tokens": 3}, greedy[:3], "length"),
        ({"max_completion_tokens": 3}, greedy[:3], "length"),
        ({"max_tokens": 40}, greedy, "stop"),
    ]:
        whole = client.chat.completions.create(
            model="chat", messages=HELLO, temperature=0, **kwargs
        )
        assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (text, finish)
        texts, reasons, _ = streamed(client, HELLO, model="chat", temperature=0, **kwargs)
        assert (texts, reasons) == ({0: text}, {0: finish})
    assert cut == ",qqq\nYVVV"  # before the first "VH"


def check_openai_error(response: httpx.Response, status: int, param: str | None, code: str):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    return error["message"]


def said(content) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


BAD_REQUESTS = [
    # body, the param and code of the error, words of its message
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages", "invalid_value", "'bot'"),
    (
        {"messages": [{"role": "assistant", "content": "a"}, *HELLO]},
        "messages", "invalid_value", "out of order",
    ),
    (
        {"messages": [*HELLO, {"role": "assistant", "content": "a"}]},
        "messages", "invalid_value", "the last message must be the user's",
    ),
    (said("a<|end|>"), "messages", "invalid_value", "'<|end|>'"),
    (said(["a"]), "messages", "invalid_value", "string 'content'"),
    ({"messages": "Hello"}, "messages", "invalid_value", "non-empty list"),
    ({}, "messages", "missing_required_parameter", "messages is missing"),
    # 70 characters + <|user|> \n <|end|> \n + <|assistant|> \n: 76 tokens
    (said("a" * 70), "messages", "context_length_exceeded", "76 tokens"),
    (said("\u00e9"), "messages", "invalid_value", "vocabulary lacks"),
    ({**said("a"), "logprobs": True}, "logprobs", "unsupported_parameter", "leave"),
    ({**said("a"), "prompt": "x"}, "prompt", "unknown_parameter", "messages"),
    ({**said("a"), "n": 0}, "n", "invalid_value", "1..8"),
    ({**said("a"), "max_tokens": 65}, "max_tokens", "invalid_value", "at most 64"),
    (
        {**said("a"), "max_tokens": 3, "max_completion_tokens": 4},
        "max_completion_tokens", "invalid_value", "differ",
    ),
]  # fmt: skip


@pytest.mark.parametrize("body, param, code, words", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(url, body, param, code, words) -> None:
    response = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert words in check_openai_error(response, 400, param, code)


def test_a_conversation_of_exactly_context_length_tokens_is_answered(url) -> None:
    # 58 characters + the template's 6 tokens: 64, the whole context; one character more is not.
    fits = httpx.post(f"{url}/v1/chat/completions", json={**said("a" * 58), "max_tokens": 1})
    assert fits.status_code == 200, fits.text
    assert json.loads(fits.text)["usage"]["prompt_tokens"] == 64
    longer = httpx.post(f"{url}/v1/chat/completions", json=said("a" * 59))
    assert "65 tokens" in check_openai_error(longer, 400, "messages", "context_length_exceeded")


def test_the_openai_client_sees_the_errors(client) -> None:
    with pytest.raises(openai.BadRequestError, match="unknown role"):
        client.chat.completions.create(model="chat", messages=[{"role": "bot", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=HELLO)


def test_a_run_without_a_template_refuses_chat_and_still_completes(tmp_path) -> None:
    raw = {"model": {"n_layer": 1, "n_head": 1, "n_embed": 8, "context_length": 16}}
    run = load_run(save_tiny_run(tmp_path / "plain", CharTokenizer("Helo \n"), raw))
    with TestClient(create_app(run, ServeSettings(batch_wait_ms=0))) as http:
        response = http.post("/v1/chat/completions", json={"messages": HELLO})
        message = check_openai_error(response, 400, "model", "no_chat_template")
        assert "no chat template" in message and "train.init_from" in message
        completion = http.post("/v1/completions", json={"prompt": "He", "max_tokens": 2})
        assert completion.status_code == 200
        assert json.loads(completion.text)["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_serving_pages_chat_example_works_as_copied(run_dir, url, client, capsys) -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text("utf-8")
    section = page[page.index("## Chat completions") :]
    served = re.search(r"llmcli serve --checkpoint (\S+)", section).group(1)
    assert Path(served).name == run_dir.name  # the run the page serves, by its folder's name
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "http://127.0.0.1:8000/v1" in code
    exec(compile(code.replace("http://127.0.0.1:8000", url), "serving.md", "exec"), {})
    printed = capsys.readouterr().out
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    greedy = client.chat.completions.create(model="chat", messages=messages, temperature=0)
    # The greedy reply, then the streamed one (sampled: it may end at once)
    assert printed.startswith(greedy.choices[0].message.content + "\n")
