"""OpenAI's response JSON: completions, their choices and stream chunks, usage, and errors.

Plain Python (no FastAPI): the shapes every answer of `llmcli serve` takes. A refusal is an
`APIError`, with OpenAI's status codes and error JSON (`{"error": {"message", "type", "param",
"code"}}`).
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A request the server refuses, as OpenAI's error JSON with an HTTP status.

    Args:
        status: the HTTP status (400 bad request, 401, 404, 413, 499 client gone, 500).
        message: what is wrong and what to send instead.
        param: the request field at fault, if one is.
        code: a short machine-readable reason (`"invalid_type"`, `"context_length_exceeded"`).
        kind: OpenAI's error type.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def to_json(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def choice_json(
    index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_json(
    completion_id: str,
    created: int,
    model_id: str,
    choices: list[dict[str, Any]],
    usage: dict[str, int] | None,
    kind: str = "text_completion",
) -> dict[str, Any]:
    """A completion, or (with `usage` None, or empty `choices`) one chunk of a stream; `kind`
    is its `object` ("chat.completion", "chat.completion.chunk" for chat)."""
    out: dict[str, Any] = {
        "id": completion_id,
        "object": kind,
        "created": created,
        "model": model_id,
        "choices": choices,
    }
    if usage is not None:
        out["usage"] = usage
    return out


def chat_choice_json(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    """A chat completion's choice: the assistant's message."""
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }


def chat_delta_json(index: int, delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
    """A chat stream chunk's choice: what the message gained (`{"role": "assistant"}` first,
    then `{"content": ...}` pieces, `{}` with the finish reason last)."""
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
