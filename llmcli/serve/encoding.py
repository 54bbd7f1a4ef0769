"""A request's prompts as token ids, refused where the model cannot take them whole.

A completion's prompts are encoded as `llmcli sample` encodes them; a chat completion's
conversation is rendered with the run's chat template first.
"""

from __future__ import annotations

from llmcli.data.chat_template import require_run_template
from llmcli.data.conversations import ConversationEncoder
from llmcli.errors import InputError
from llmcli.generation.chat import reply_stop_ids
from llmcli.generation.prompts import encode_prompt, too_long_message
from llmcli.runs.loading import LoadedRun
from llmcli.serve.request import ChatRequest
from llmcli.serve.response import APIError


def request_prompt_ids(run: LoadedRun, prompts: list[str]) -> list[list[int]]:
    """Each prompt's token ids; a prompt longer than the context is refused, as is text the
    tokenizer cannot encode (generation past the context is the context policy's business, but
    a prompt cut short would answer another question)."""
    ctx = run.model.context_length
    out = []
    for i, prompt in enumerate(prompts):
        label = "the prompt" if len(prompts) == 1 else f"prompt {i}"
        try:
            ids, cropped = encode_prompt(run.tokenizer, prompt, ctx, label=label)
        except InputError as exc:
            raise APIError(400, str(exc), param="prompt", code="invalid_value") from None
        if cropped:
            fix = (
                "shorten it (the completion itself may go on past the context: the run's "
                f"context policy is {run.config.sample.context_policy})."
            )
            n_tokens = len(run.tokenizer.encode(prompt))
            message = too_long_message(label, n_tokens, ctx, fix, served=True)
            raise APIError(400, message, param="prompt", code="context_length_exceeded")
        out.append(ids)
    return out


class ChatEncoding:
    """The run's chat template and the ids of conversations, for `/v1/chat/completions`.

    A run without a template (or with one its tokenizer cannot encode) still serves
    `/v1/completions`; its chat requests get the reason, as a 400.
    """

    def __init__(self, run: LoadedRun) -> None:
        self.context_length = run.model.context_length
        self._encoder: ConversationEncoder | None = None
        self._stop_ids: tuple[int, ...] = ()
        self._error: str | None = None
        try:
            self._encoder = ConversationEncoder(require_run_template(run.run_dir), run.tokenizer)
            self._stop_ids = reply_stop_ids(self._encoder)
        except InputError as exc:
            self._error = f"this model does not chat: {exc}"

    def encoder(self) -> tuple[ConversationEncoder, tuple[int, ...]]:
        """The encoder and the ids that end a reply, or the 400 of a run that cannot chat."""
        if self._encoder is None:
            raise APIError(400, str(self._error), param="model", code="no_chat_template")
        return self._encoder, self._stop_ids

    def encode(self, encoder: ConversationEncoder, request: ChatRequest) -> tuple[str, list[int]]:
        """The prompt's text and ids; a conversation longer than the context is refused (the
        client chooses what to leave out, where `llmcli chat` drops the oldest turns)."""
        try:
            text = encoder.render(request.messages, add_generation_prompt=True).text
            ids = encoder.prompt(request.messages)
        except InputError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from None
        ctx = self.context_length
        if len(ids) > ctx:
            raise APIError(
                400,
                f"the conversation is {len(ids)} tokens long once rendered with the chat template, "
                f"but this model's context_length is {ctx} tokens: leave out its oldest turns.",
                param="messages",
                code="context_length_exceeded",
            )
        return text, ids
