"""A request's answer from the batcher's events: one JSON body, or server-sent events.

The events are gathered into one completion, or streamed as they come; an error is OpenAI's error
JSON (`error_response`). A client that disconnects cancels its request: its rows stop at the next
step, the access log shows the request with status 499, and the server goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmcli.serve.batcher import Batcher, Done, Echo, End, Event, Text, Work
from llmcli.serve.logprobs import TokenLogprob, logprobs_json
from llmcli.serve.request import CompletionRequest
from llmcli.serve.response import (
    APIError,
    chat_choice_json,
    chat_delta_json,
    choice_json,
    completion_json,
    usage_json,
)

# How often a request waiting for its answer checks that its client is still connected.
DISCONNECT_POLL_S = 0.05
# uvicorn's access log, where `log_client_gone` adds the line of a request whose client hung up.
ACCESS_LOG = logging.getLogger("uvicorn.access")


class _ErrorJSON(JSONResponse):
    """Error JSON written in ASCII: a message or `param` may quote the request's text, and a lone
    surrogate in it (`"\\ud800"` is valid JSON) has no UTF-8 form, which Starlette's JSON needs."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(error: APIError, headers: Mapping[str, str] | None = None) -> Response:
    """OpenAI's error JSON for `error`, with its HTTP status."""
    return _ErrorJSON(error.to_json(), status_code=error.status, headers=headers)


def log_client_gone(scope: dict[str, Any]) -> None:
    """Log status 499 (nginx's "client closed request") for a request whose client hung up.

    The line is uvicorn's access-log line, on its logger and in its format
    (`127.0.0.1:50312 - "POST /v1/completions HTTP/1.1" 499`): uvicorn logs a response when it
    starts, so a stream has its 200 line from its first chunk, and it drops, unlogged, the
    response to a client already gone, so a request given up on would leave no line at all.
    """
    client = scope.get("client")
    path = urllib.parse.quote(scope["path"])  # as uvicorn writes the path
    if scope.get("query_string"):
        path += "?" + scope["query_string"].decode("ascii", "backslashreplace")
    ACCESS_LOG.info(
        '%s - "%s %s HTTP/%s" %d',
        f"{client[0]}:{client[1]}" if client else "",
        scope["method"],
        path,
        scope["http_version"],
        499,
    )


def client_gone(scope: dict[str, Any]) -> APIError:
    """The error of a request whose client hung up, logged."""
    log_client_gone(scope)
    return APIError(499, "the client closed the connection.", code="client_gone")


async def respond(
    batcher: Batcher, answer: Answer, ids: list[list[int]], http: Request
) -> Response:
    """Submit the answer's request (its prompts' `ids`) and answer it, streamed or whole."""
    work = Work(answer.request, ids, _deliver_to(answer.queue))
    batcher.submit(work)
    if answer.request.stream:
        return StreamingResponse(answer.events(work), media_type="text/event-stream")
    return await answer.collect(work, http.is_disconnected)


def _deliver_to(events: asyncio.Queue[list[Event]]) -> Callable[[list[Event]], None]:
    """A thread-safe way for the generation thread to put events on this loop's queue."""
    loop = asyncio.get_running_loop()

    def deliver(batch: list[Event]) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, batch)
        except RuntimeError:  # the loop has closed: the server is shutting down
            pass

    return deliver


class Answer:
    """One request's answer, built from its events: all at once, or as server-sent events."""

    def __init__(
        self,
        request: CompletionRequest,
        ids: list[list[int]],
        model_id: str,
        scope: dict[str, Any],
        chat: bool = False,
    ) -> None:
        self.request = request
        self.scope = scope  # the HTTP request's, for the log line of a client gone
        self.chat = chat  # a chat completion: messages and deltas instead of texts
        self.queue: asyncio.Queue[list[Event]] = asyncio.Queue()
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_id = model_id
        self.prompt_tokens = sum(len(i) for i in ids)
        rows = request.rows
        self.texts: list[list[str]] = [[] for _ in range(rows)]
        self.entries: list[list[TokenLogprob]] = [[] for _ in range(rows)]
        self.echoed: list[list[TokenLogprob]] = [[] for _ in request.prompts]
        self.finish: list[str | None] = [None] * rows
        self.tokens = [0] * rows

    def prompt_of(self, choice: int) -> str:
        return self.request.prompts[choice // self.request.n]

    def offset(self, choice: int) -> int:
        """Where the completion starts in the choice's text (after an echoed prompt)."""
        return len(self.prompt_of(choice)) if self.request.echo else 0

    def usage(self) -> dict[str, int]:
        return usage_json(self.prompt_tokens, sum(self.tokens))

    async def collect(self, work: Work, disconnected: Callable[[], Awaitable[bool]]) -> Response:
        """Wait for every event, then answer in one JSON; a client gone cancels the work.

        The connection is checked every `DISCONNECT_POLL_S`, also while events keep coming.
        """
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_S
        while True:
            try:
                events = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                events = []
            if loop.time() >= next_check:
                next_check = loop.time() + DISCONNECT_POLL_S
                if await disconnected():
                    work.cancel()
                    return error_response(client_gone(self.scope))
            for event in events:
                if isinstance(event, Done):
                    if event.failed is not None:
                        raise event.failed
                    return JSONResponse(self._completion())
                self._record(event)

    def _record(self, event: Event) -> None:
        if isinstance(event, Text):
            self.texts[event.index].append(event.text)
            self.entries[event.index].extend(event.logprobs or [])
        elif isinstance(event, End):
            self.finish[event.index], self.tokens[event.index] = event.finish_reason, event.tokens
        elif isinstance(event, Echo):
            self.echoed[event.prompt_index] = event.logprobs

    def _completion(self) -> dict[str, Any]:
        if self.chat:
            choices = [
                chat_choice_json(c, "".join(self.texts[c]), self.finish[c])
                for c in range(self.request.rows)
            ]
            return completion_json(
                self.id, self.created, self.model_id, choices, self.usage(), "chat.completion"
            )
        choices = []
        for c in range(self.request.rows):
            text = "".join(self.texts[c])
            logprobs = None
            if self.request.logprobs is not None:
                offset = self.offset(c)
                echoed = self.echoed[c // self.request.n] if self.request.echo else []
                entries = logprobs_json(echoed)
                shifted = logprobs_json(self.entries[c], offset)
                logprobs = {key: entries[key] + shifted[key] for key in entries}
            if self.request.echo:
                text = self.prompt_of(c) + text
            choices.append(choice_json(c, text, logprobs, self.finish[c]))
        return completion_json(self.id, self.created, self.model_id, choices, self.usage())

    async def events(self, work: Work) -> AsyncIterator[str]:
        """Server-sent events: one chunk per piece of text, one per choice's end, the usage if
        asked, then `data: [DONE]`. A client gone cancels the work, and is logged."""
        done = False
        try:
            if self.chat:  # OpenAI's first chunk of each choice names the role
                for c in range(self.request.rows):
                    yield self._chunk(
                        [chat_delta_json(c, {"role": "assistant", "content": ""}, None)]
                    )
            elif self.request.echo and self.request.logprobs is None:
                for c in range(self.request.rows):
                    yield self._chunk([choice_json(c, self.prompt_of(c), None, None)])
            while not done:
                chunks = []
                for event in await self.queue.get():
                    if isinstance(event, Done):
                        done = True
                        if event.failed is not None:
                            chunks.append(_sse(event.failed.to_json()))
                    else:
                        self._record(event)
                        chunks.extend(self._event_chunks(event))
                if chunks:
                    yield "".join(chunks)
            if self.request.include_usage:
                yield _sse(
                    completion_json(
                        self.id, self.created, self.model_id, [], self.usage(), self._kind()
                    )
                )
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                work.cancel()
                log_client_gone(self.scope)

    def _event_chunks(self, event: Event) -> list[str]:
        if self.chat:
            if isinstance(event, Text) and event.text:
                return [self._chunk([chat_delta_json(event.index, {"content": event.text}, None)])]
            if isinstance(event, End):
                return [self._chunk([chat_delta_json(event.index, {}, event.finish_reason)])]
            return []
        wants = self.request.logprobs is not None
        if isinstance(event, Text):
            logprobs = logprobs_json(event.logprobs, self.offset(event.index)) if wants else None
            return [self._chunk([choice_json(event.index, event.text, logprobs, None)])]
        if isinstance(event, End):
            return [self._chunk([choice_json(event.index, "", None, event.finish_reason)])]
        if isinstance(event, Echo):  # echo with log-probs: the prompt with its tokens' log-probs
            n = self.request.n
            prompt = self.request.prompts[event.prompt_index]
            logprobs = logprobs_json(event.logprobs)
            first = event.prompt_index * n
            return [
                self._chunk([choice_json(c, prompt, logprobs, None)])
                for c in range(first, first + n)
            ]
        return []

    def _kind(self) -> str:
        """A stream chunk's `object`."""
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, choices: list[dict[str, Any]]) -> str:
        return _sse(
            completion_json(self.id, self.created, self.model_id, choices, None, self._kind())
        )


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
