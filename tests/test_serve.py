"""`llmcli serve`: the OpenAI-compatible server, on a tiny run, started on a free port in a thread.

Outputs are compared with `llmcli sample` (the library's `sample_texts` and the command line), the
log-probs with a plain forward pass and NumPy's log-softmax; errors through plain HTTP.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import uvicorn
from conftest import save_tiny_run
from fastapi.testclient import TestClient
from terminal_helpers import CTRL_C, Terminal

from llmcli.cli import main
from llmcli.data.tokenizer import CharTokenizer
from llmcli.generation.batching import SampleOptions, sample_texts
from llmcli.runs.loading import load_run
from llmcli.serve.app import ServeSettings, create_app
from llmcli.serve.batcher import Batcher, Done, End, Text, Work
from llmcli.serve.logprobs import RowLogprobs, TokenTexts, step_logprobs
from llmcli.serve.request import Limits, parse_completion
from llmcli.serve.response import APIError
from llmcli.serve.server import bind

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me!\n"
LIMITS = Limits(max_tokens=100_000, max_rows=16, max_body_bytes=4096)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    raw = {
        "model": {"n_layer": 2, "n_head": 2, "n_embed": 32, "context_length": 32},
        "sample": {"max_new_tokens": 20, "temperature": 1.0, "top_k": 10, "seed": 3},
    }
    # No end-of-text token: every sample runs to max_tokens or a stop string, which the
    # disconnect test needs (an untrained model draws one at random).
    tokenizer = CharTokenizer(sorted(set(TEXT)), eot=None)
    return save_tiny_run(tmp_path_factory.mktemp("runs") / "tiny", tokenizer, raw, sharpen=8.0)


@pytest.fixture(scope="module")
def run(run_dir):
    return load_run(run_dir)


def poll(condition: Callable[[], bool], tries: int, pause_s: float) -> bool:
    """Whether `condition()` comes true within `tries` looks, `pause_s` apart: the looks are
    counted, not timed, so a busy machine gets as many as an idle one."""
    for _ in range(tries):
        if condition():
            return True
        time.sleep(pause_s)
    return condition()


@contextmanager
def running(app) -> Iterator[str]:
    """Serve `app` on a free local port in a thread; yields its base URL."""
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert poll(lambda: server.started, tries=1000, pause_s=0.01), "the server did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def url(run) -> Iterator[str]:
    with running(create_app(run, ServeSettings(limits=LIMITS, batch_wait_ms=2))) as base:
        yield base


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def expected(run, prompts, n=1, stop=(), **settings):
    """What `llmcli sample` generates: `sample_texts` with the run's settings changed."""
    config = dataclasses.replace(run.config.sample, **settings)
    options = SampleOptions(num_samples=n, stop=stop)
    return sample_texts(run.model, run.tokenizer, prompts, config, options)


def health(url: str) -> dict:
    return httpx.get(f"{url}/health").json()


# ----------------------------------------------------------------------------- equal to sample


def test_completion_equals_sample_for_a_list_of_prompts_and_n(run, client) -> None:
    prompts = ["ROMEO:", "JULIET: Ay"]
    reply = client.completions.create(
        model="tiny", prompt=prompts, n=3, seed=11, max_tokens=25, temperature=0.9,
        top_p=0.95, stop=["!"], extra_body={"top_k": 12},
    )  # fmt: skip
    samples = expected(
        run, prompts, n=3, stop=("!",), seed=11, max_new_tokens=25, temperature=0.9, top_p=0.95,
        top_k=12,
    )  # fmt: skip
    assert [c.text for c in reply.choices] == [s.completion for s in samples]
    assert [c.index for c in reply.choices] == list(range(6))
    assert [c.finish_reason for c in reply.choices] == [s.stop_reason for s in samples]
    assert len(set(c.text for c in reply.choices)) > 1  # the seeds differ per choice
    assert reply.usage.prompt_tokens == len("ROMEO:") + len("JULIET: Ay")  # char tokens
    assert reply.usage.completion_tokens == sum(s.tokens for s in samples)
    assert reply.model == "tiny" and reply.object == "text_completion"


def test_streamed_text_equals_the_command_line(run, run_dir, client, capsys) -> None:
    [alone] = expected(run, ["ROMEO:"], seed=7, max_new_tokens=30)
    stream = client.completions.create(
        model="tiny", prompt="ROMEO:", seed=7, max_tokens=30, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert len(chunks) > 3 and finish == [alone.stop_reason]
    assert chunks[-1].usage.completion_tokens == alone.tokens and chunks[-1].choices == []
    with pytest.raises(SystemExit) as exc:
        main(["sample", "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--seed", "7",
              "--max-new-tokens", "30", "--no-stream"])  # fmt: skip
    assert exc.value.code == 0
    assert capsys.readouterr().out == "ROMEO:" + text + ("" if text.endswith("\n") else "\n")


def test_stream_is_server_sent_events_ending_with_done(url) -> None:
    body = {"prompt": "JULIET:", "max_tokens": 8, "seed": 1, "n": 2, "stream": True, "echo": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    reply = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}).json()
    assert texts == [c["text"] for c in reply["choices"]]
    assert all(t.startswith("JULIET:") for t in texts)  # echo


def test_concurrent_requests_each_get_their_own_text(run, url) -> None:
    bodies = [{"prompt": p, "seed": s, "max_tokens": 15} for p in ("a", "ROMEO:") for s in (1, 2)]
    bodies += [{"prompt": "b", "seed": 5, "max_tokens": 15, "stop": "e"}]  # another batch
    replies: list = [None] * len(bodies)

    def post(i: int) -> None:
        replies[i] = httpx.post(f"{url}/v1/completions", json=bodies[i], timeout=30).json()

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for body, reply in zip(bodies, replies, strict=True):
        stop = (body["stop"],) if "stop" in body else ()
        [alone] = expected(run, [body["prompt"]], stop=stop, seed=body["seed"], max_new_tokens=15)
        assert reply["choices"][0]["text"] == alone.completion


def test_requests_waiting_together_run_as_one_batch_per_setting(run) -> None:
    batcher = Batcher(run.model, run.tokenizer, max_rows=16, wait_s=0.0)
    settings = [("ab", 1, 1.0), ("ROMEO:", 2, 1.0), ("J", 3, 1.0), ("ab", 4, 0.0)]
    works, events = [], []
    for prompt, seed, temperature in settings:
        body = {"prompt": prompt, "seed": seed, "temperature": temperature, "n": 2}
        request = parse_completion(body, run.config.sample, LIMITS, "tiny")
        got: list = []
        events.append(got)
        works.append(Work(request, [run.tokenizer.encode(prompt)], got.extend))
    for work in works:  # all waiting before the thread starts
        batcher.submit(work)
    batcher.start()
    batcher.close()
    assert batcher.stats.batches == 2 and batcher.stats.largest_batch == 6
    assert batcher.stats.rows == 8 and batcher.stats.requests == 4
    for (prompt, seed, temperature), got in zip(settings, events, strict=True):
        assert isinstance(got[-1], Done) and got[-1].failed is None
        texts = ["", ""]
        for event in got:
            if isinstance(event, Text):
                texts[event.index] += event.text
        alone = expected(run, [prompt], n=2, seed=seed, temperature=temperature)
        assert texts == [s.completion for s in alone]
        ends = sorted((e.index, e.finish_reason, e.tokens) for e in got if isinstance(e, End))
        assert ends == [(i, "length", 20) for i in range(2)]


# ----------------------------------------------------------------------------- log-probs


def forward_logprobs(run, ids: list[int]) -> np.ndarray:
    """`(T, V)` log-probs of the token after each position: one plain forward, NumPy softmax."""
    with torch.no_grad():
        logits, _ = run.model(torch.tensor([ids]))
    x = logits[0].double().numpy()[:, : run.tokenizer.vocab_size]
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_logprobs_and_echo_match_a_plain_forward(run, client) -> None:
    prompt = "ROMEO: But"
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=3, echo=True
    )
    choice = reply.choices[0]
    assert choice.text.startswith(prompt)
    ids = run.tokenizer.encode(choice.text)  # a char run: one token per character
    lp = forward_logprobs(run, ids)
    logprobs = choice.logprobs
    assert logprobs.tokens == list(choice.text)
    assert logprobs.text_offset == list(range(len(choice.text)))
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    want = [lp[t - 1, ids[t]] for t in range(1, len(ids))]
    np.testing.assert_allclose(logprobs.token_logprobs[1:], want, atol=1e-4)
    for t in range(1, len(ids)):
        top = np.argsort(-lp[t - 1], kind="stable")[:3]
        got = logprobs.top_logprobs[t]
        assert set(got) == {run.tokenizer.decode([int(i)]) for i in top}
        np.testing.assert_allclose(sorted(got.values()), sorted(lp[t - 1, top]), atol=1e-4)
    # Greedy: every generated token is the most likely one.
    for t in range(len(prompt), len(ids)):
        assert logprobs.token_logprobs[t] == pytest.approx(lp[t - 1].max(), abs=1e-4)


def test_step_logprobs_list_the_top_n_or_the_whole_vocabulary_when_it_is_smaller() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.5, 1.0]])  # (2, 4)
    logp = torch.log_softmax(logits, dim=-1)
    ids = torch.tensor([2, 0])
    chosen, tops = step_logprobs(logits, ids, top_k=2)
    assert chosen == pytest.approx([logp[0, 2].item(), logp[1, 0].item()])
    assert [[i for i, _ in row] for row in tops] == [[1, 2], [0, 3]]
    assert tops[0][0][1] == pytest.approx(logp[0, 1].item())
    _, tops = step_logprobs(logits, ids, top_k=4)  # as many as the vocabulary
    assert [[i for i, _ in row] for row in tops] == [[1, 2, 0, 3], [0, 3, 2, 1]]
    _, tops = step_logprobs(logits, ids, top_k=5)  # more: all 4
    assert [len(row) for row in tops] == [4, 4]
    assert step_logprobs(logits, ids, top_k=0)[1] == [[], []]


def test_a_rows_entries_come_out_with_the_text_that_ends_them_listing_its_own_top_n() -> None:
    """A batch computes the largest top-N of its rows; a row that asked for 1 lists 1. An
    entry is released once the text sent reaches its end, not a character later."""
    row = RowLogprobs(TokenTexts(CharTokenizer(["a", "b", "c"], eot=None)), top_k=1)
    top = [(2, -0.1), (1, -2.0), (0, -3.0)]  # the batch's top 3: another row asked for 3
    for token in (0, 1, 2):
        row.add(token, -1.0, top)
    first = row.release(2)  # "ab" sent: the tokens that end at 1 and at 2
    assert [(e.token, e.start) for e in first] == [("a", 0), ("b", 1)]
    assert all(e.top == {"c": -0.1} for e in first)
    assert row.release(2) == []
    assert [e.token for e in row.release(3)] == ["c"]


def test_logprobs_take_0_to_5_as_openai_does(run) -> None:
    for n in (0, 5):
        body = {"prompt": "a", "logprobs": n}
        assert parse_completion(body, run.config.sample, LIMITS, "tiny").logprobs == n
    for n in (-1, 6):
        with pytest.raises(APIError) as exc:
            parse_completion({"prompt": "a", "logprobs": n}, run.config.sample, LIMITS, "tiny")
        assert (exc.value.status, exc.value.param, exc.value.code) == (
            400,
            "logprobs",
            "invalid_value",
        )


def test_streamed_logprobs_equal_the_whole_answer_and_stop_at_the_stop(url) -> None:
    body = {"prompt": "JULIET:", "max_tokens": 30, "seed": 2, "logprobs": 1, "stop": ["e", "t"]}
    whole = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
    tokens, offsets = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    if choice["logprobs"]:
                        tokens += choice["logprobs"]["tokens"]
                        offsets += choice["logprobs"]["text_offset"]
    assert "".join(whole["logprobs"]["tokens"]) == whole["text"]  # the stop's token left out
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]


# ----------------------------------------------------------------------------- endpoints, errors


def test_models_and_health(run, url, client) -> None:
    [card] = client.models.list().data
    assert card.id == "tiny" and card.owned_by == "llmcli"
    raw = httpx.get(f"{url}/v1/models/tiny").json()
    assert raw["context_length"] == 32 and raw["tokenizer"] == "char"
    assert raw["vocab_size"] == run.tokenizer.vocab_size
    assert health(url)["status"] == "ok"


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"prompt": "a", "temprature": 1}, 400, "temprature", "unknown_parameter"),
        ({"prompt": 3}, 400, "prompt", "invalid_type"),
        ({"prompt": ["a", 1]}, 400, "prompt", "invalid_type"),
        ({}, 400, "prompt", "missing_required_parameter"),
        ({"prompt": "a", "max_tokens": "9"}, 400, "max_tokens", "invalid_type"),
        ({"prompt": "a", "max_tokens": 100_001}, 400, "max_tokens", "invalid_value"),
        ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
        ({"prompt": "a", "temperature": -1}, 400, "temperature", "invalid_value"),
        ({"prompt": "a", "temperature": True}, 400, "temperature", "invalid_type"),
        ({"prompt": "a", "top_p": 0}, 400, "top_p", "invalid_value"),
        ({"prompt": "a", "top_k": 0}, 400, "top_k", "invalid_value"),
        ({"prompt": "a", "top_k": 2.5}, 400, "top_k", "invalid_type"),
        ({"prompt": "a", "seed": 2**63}, 400, "seed", "invalid_value"),
        ({"prompt": "a", "context_policy": "exact"}, 400, "context_policy", "unknown_parameter"),
        ({"prompt": "a", "stream": "yes"}, 400, "stream", "invalid_type"),
        ({"prompt": "a", "n": 17}, 400, "n", "invalid_value"),
        ({"prompt": ["a"] * 9, "n": 2}, 400, "n", "invalid_value"),
        ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
        ({"prompt": "a", "logprobs": 6}, 400, "logprobs", "invalid_value"),
        ({"prompt": "a", "presence_penalty": 1.0}, 400, "presence_penalty", None),
        ({"prompt": "a" * 33}, 400, "prompt", "context_length_exceeded"),
        ({"prompt": "a", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ],
)
def test_bad_requests_get_openai_errors(url, body, status, param, code) -> None:
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    assert param is None or param in error["message"] or "prompt" in error["message"]


def test_the_openai_client_sees_the_errors(client) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt="a", max_tokens=100_001)
    assert "at most 100000 new tokens" in str(exc.value)


def test_bodies_over_the_limit_and_not_json_are_refused(url) -> None:
    big = json.dumps({"prompt": "a" * 5000}).encode()
    response = httpx.post(f"{url}/v1/completions", content=big)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(f"{url}/v1/completions", content=iter([big[:3000], big[3000:]]))
    assert chunked.status_code == 413  # no Content-Length: counted as it is read
    response = httpx.post(f"{url}/v1/completions", content=b"{not json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    response = httpx.get(f"{url}/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()


HUGE = b"1" + b"0" * 400  # 10**400: an integer, but past float's range
# Request bodies Python's JSON reader, or the checks after it, once answered with a 500, and the
# error each must get instead: {id: (body, param, code)}.
HOSTILE = {
    "deep": (b"[" * 2000 + b"]" * 2000, None, "invalid_json"),  # past Python's recursion limit
    "deep-prompt": (b'{"prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}", None, "invalid_json"),
    "900-deep-prompt": (b'{"prompt": ' + b"[" * 900 + b"]" * 900 + b"}", "prompt", "invalid_type"),
    "nan": (b'{"prompt": "a", "temperature": NaN}', None, "invalid_json"),  # not JSON
    "-infinity": (b'{"prompt": "a", "top_p": -Infinity}', None, "invalid_json"),
    "1e400": (b'{"prompt": "a", "temperature": 1e400}', "temperature", "invalid_type"),
    "huge-temp": (b'{"prompt": "a", "temperature": %s}' % HUGE, "temperature", "invalid_type"),
    "huge-top_p": (b'{"prompt": "a", "top_p": %s}' % HUGE, "top_p", "invalid_type"),
    "huge-max_tokens": (b'{"prompt": "a", "max_tokens": %s}' % HUGE, "max_tokens", "invalid_value"),
    "huge-n": (b'{"prompt": "a", "n": %s}' % HUGE, "n", "invalid_value"),
    "huge-seed": (b'{"prompt": "a", "seed": %s}' % HUGE, "seed", "invalid_value"),
    "list-max_tokens": (b'{"prompt": "a", "max_tokens": [1]}', "max_tokens", "invalid_type"),
    "dict-temperature": (b'{"prompt": "a", "temperature": {}}', "temperature", "invalid_type"),
    "list-options": (b'{"prompt": "a", "stream_options": [1]}', "stream_options", None),
    "surrogate-key": (b'{"\\ud800": 1}', "\ud800", "unknown_parameter"),  # a lone surrogate
    "surrogate-prompt": (b'{"prompt": "\\ud800"}', "prompt", "invalid_value"),
    "surrogate-echo": (b'{"prompt": ["a", "b\\udfff"], "echo": true}', "prompt", "invalid_value"),
    "surrogate-model": (b'{"prompt": "a", "model": "\\ud800"}', "model", "model_not_found"),
    "not-utf8": (b'{"prompt": "\xff"}', None, "invalid_json"),
    "empty": (b"", None, "invalid_json"),
    "list": (b"[]", None, "invalid_type"),
    "null": (b"null", None, "invalid_type"),
    "string": (b'"prompt"', None, "invalid_type"),
}


@pytest.mark.parametrize(("body", "param", "code"), list(HOSTILE.values()), ids=list(HOSTILE))
def test_bodies_python_cannot_take_get_4xx_openai_errors(url, body, param, code) -> None:
    for content_type in ("application/json", "text/plain"):
        headers = {"content-type": content_type}
        response = httpx.post(f"{url}/v1/completions", content=body, headers=headers)
        assert 400 <= response.status_code < 500, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param and error["code"] == code
        assert error["type"] == "invalid_request_error" and len(error["message"]) < 400


def test_an_error_in_the_server_is_still_openai_json(run, monkeypatch) -> None:
    def broken(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr("llmcli.serve.app.parse_completion", broken)
    with TestClient(create_app(run), raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"prompt": "a"})
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert "RuntimeError" in response.json()["error"]["message"]


def access_lines(caplog, status: int) -> list[str]:
    """The access-log lines (uvicorn's format, without its level prefix) with this status."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "uvicorn.access" and len(r.args) == 5 and r.args[4] == status
    ]


def test_a_client_that_goes_away_is_logged_with_499(url, caplog) -> None:
    caplog.set_level(logging.INFO, logger="uvicorn.access")
    body = {"prompt": "a", "max_tokens": 100_000, "seed": 1}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        next(r.iter_lines())  # streaming; then hang up
    with pytest.raises(httpx.ReadTimeout):  # a plain request, given up on
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
        # Half a body, then gone.
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99\r\n\r\n{")
        time.sleep(0.2)
    poll(lambda: len(access_lines(caplog, 499)) >= 3, tries=100, pause_s=0.05)
    gone = access_lines(caplog, 499)
    assert len(gone) == 3
    line = re.compile(r'127\.0\.0\.1:\d+ - "POST /v1/completions HTTP/1\.1" 499$')
    assert all(line.match(text) for text in gone), gone
    # The stream's own line, from when it began, is uvicorn's: the same format.
    [started] = access_lines(caplog, 200)
    assert started.split(" - ")[0] == gone[0].split(" - ")[0]  # the stream's client
    assert started.removesuffix(" 200") == gone[0].removesuffix(" 499")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_client_that_goes_away_stops_its_generation(url) -> None:
    before = health(url)
    body = {"prompt": "a", "max_tokens": 100_000, "seed": 1}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        next(r.iter_lines())  # the first chunk has come: generation runs; then hang up
    with pytest.raises(httpx.ReadTimeout):  # a plain request, given up on
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
    poll(lambda: health(url)["cancelled"] >= before["cancelled"] + 2, tries=100, pause_s=0.05)
    after = health(url)
    assert after["cancelled"] == before["cancelled"] + 2
    assert after["tokens"] - before["tokens"] < 2 * 100_000  # both stopped early
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 3})
    assert reply.status_code == 200  # the server goes on


# ----------------------------------------------------------------------------- API key, CLI


def test_an_api_key_is_required_on_every_request(run) -> None:
    with running(create_app(run, ServeSettings(api_key="s3cret", limits=LIMITS))) as base:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = httpx.get(f"{base}/health", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{base}/health", headers={"Authorization": "Bearer s3cret"}).is_success
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="a", max_tokens=2).choices
        bad = openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny", prompt="a", max_tokens=2)


def serve_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, dict]:
    """`llmcli serve ARGS` up to the point it would serve: what it would run, and its stderr."""
    seen: dict = {}

    def fake_run(self, sockets=None):
        seen["sockets"] = sockets
        seen["app"] = self.config.app

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    with pytest.raises(SystemExit) as exc:
        main(["serve", *args])
    for sock in seen.get("sockets") or []:
        sock.close()
    return exc.value.code, capsys.readouterr().err, seen


def test_cli_warns_about_an_open_bind_without_a_key(run_dir, monkeypatch, capsys) -> None:
    monkeypatch.delenv("LLMCLI_API_KEY", raising=False)
    code, err, seen = serve_cli(
        monkeypatch, capsys, "--checkpoint", str(run_dir), "--host", "0.0.0.0", "--port", "0"
    )
    assert code == 0 and "warning: serving on 0.0.0.0" in err and seen["app"] is not None
    monkeypatch.setenv("LLMCLI_API_KEY", "k")
    code, err, _ = serve_cli(
        monkeypatch, capsys, "--checkpoint", str(run_dir), "--host", "0.0.0.0", "--port", "0"
    )
    assert code == 0 and "warning" not in err
    code, err, _ = serve_cli(monkeypatch, capsys, "--checkpoint", str(run_dir), "--port", "0")
    assert code == 0 and "warning" not in err and "http://127.0.0.1:" in err


def test_cli_without_the_extra_or_with_a_taken_port_exits_2(run_dir, monkeypatch, capsys):
    taken = bind("127.0.0.1", 0)
    try:
        port = str(taken.getsockname()[1])
        code, err, _ = serve_cli(monkeypatch, capsys, "--checkpoint", str(run_dir), "--port", port)
        assert code == 2 and "choose another --port" in err
    finally:
        taken.close()
    monkeypatch.setitem(__import__("sys").modules, "fastapi", None)
    code, err, _ = serve_cli(monkeypatch, capsys, "--checkpoint", str(run_dir))
    assert code == 2 and "pip install 'llmcli[serve]'" in err


def test_protocol_errors_are_api_errors_without_a_server(run) -> None:
    with pytest.raises(APIError) as exc:
        parse_completion([], run.config.sample, LIMITS, "tiny")
    assert exc.value.status == 400
    request = parse_completion({"prompt": "a"}, run.config.sample, LIMITS, "tiny")
    assert request.config.max_new_tokens == 20 and request.config.top_k == 10
    other = parse_completion({"prompt": "a"}, run.config.sample, LIMITS, "tiny")
    assert request.config.seed != other.config.seed  # no seed: a fresh one per request
    assert request.batch_key() == other.batch_key()
    body = {"prompt": "a", "top_k": None, "temperature": None, "seed": None}
    nulls = parse_completion(body, run.config.sample, LIMITS, "tiny").config
    assert nulls.top_k is None and nulls.temperature == 1.0  # top_k null keeps every token
    with pytest.raises(APIError, match=r"temperature \(-1.0\) must be a number >= 0: 0 is greedy"):
        parse_completion({"prompt": "a", "temperature": -1}, run.config.sample, LIMITS, "tiny")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["key", "process group"])
def test_ctrl_c_from_a_terminal_stops_the_server_cleanly(run_dir, how) -> None:
    term = Terminal(["llmcli", "serve", "--checkpoint", str(run_dir), "--port", "0"])
    try:
        term.wait_for("Application startup complete", 120)
        if how == "key":
            term.press(CTRL_C)
        else:  # what a terminal does for the key: SIGINT to every process of the group
            os.killpg(term.proc.pid, signal.SIGINT)
        assert term.wait(60) == 130  # interrupted, as every command's Ctrl-C
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
    assert b"Shutting down" in term.raw and b"Finished server process" in term.raw
    assert b"Traceback" not in term.raw
