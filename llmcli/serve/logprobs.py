"""Log-probs for the completions API: the chosen token's and the most likely ones at each step,
kept in step with a choice's text.

The log-probs are the model's own distribution (`log_softmax` of the logits a step drew from,
before temperature, top-k and top-p), as OpenAI's are. A choice's text is released only when it
can no longer be the start of a stop string (`llmcli.generation.detokenize`), so `RowLogprobs` holds
each token until the text released covers it, and at the end keeps only the tokens that begin
inside the final text (a stop string's tokens are not part of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from llmcli.data.tokenizer import CharTokenizer, Tokenizer


@dataclass(frozen=True)
class TokenLogprob:
    """One token of a text: its string, log-prob, most likely alternatives and offset.

    Attributes:
        token: the token's own text.
        logprob: its log-prob given what comes before (None for a text's first token).
        top: the most likely tokens there, text -> log-prob (None where `logprob` is None).
        start: where the token begins in its text (characters).
    """

    token: str
    logprob: float | None
    top: dict[str, float] | None
    start: int


class TokenTexts:
    """Token ids to the strings the API shows, and where the tokens of a text end."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.chars = tokenizer.token_texts if isinstance(tokenizer, CharTokenizer) else None
        self._cache: dict[int, str] = {}

    def text(self, token: int) -> str:
        if self.chars is not None:
            return self.chars[token]
        if token not in self._cache:
            self._cache[token] = self.tokenizer.decode([token])
        return self._cache[token]

    def end(self, ids: list[int], previous_end: int) -> int:
        """Where the text of `ids` ends once its last token is added (after `previous_end`).

        A byte-level token that ends inside a multi-byte character ends where the text before
        the character does; the token that completes the character ends after it.
        """
        if self.chars is not None:
            return previous_end + len(self.chars[ids[-1]])
        return len(self.tokenizer.decode(ids).rstrip("\ufffd"))


class RowLogprobs:
    """One choice's tokens and their log-probs, released as its text is.

    Args:
        texts: the token strings.
        top_k: how many most likely tokens each entry lists (0: none).
    """

    def __init__(self, texts: TokenTexts, top_k: int) -> None:
        self.texts = texts
        self.top_k = top_k
        self.ids: list[int] = []
        self.pending: list[tuple[TokenLogprob, int]] = []  # (entry, where its text ends)
        self.end = 0
        self.released = 0
        self.closed = False

    def add(self, token: int, logprob: float, top: list[tuple[int, float]]) -> None:
        """The step's token with its log-prob and the `top_k` most likely `(id, log-prob)`."""
        if self.closed:
            return
        self.ids.append(token)
        start, self.end = self.end, self.texts.end(self.ids, self.end)
        shown = {self.texts.text(i): lp for i, lp in top[: self.top_k]}
        self.pending.append((TokenLogprob(self.texts.text(token), logprob, shown, start), self.end))

    def release(self, length: int) -> list[TokenLogprob]:
        """The entries of the tokens now inside the first `length` characters of the text."""
        self.released = length
        n = 0
        while n < len(self.pending) and self.pending[n][1] <= length:
            n += 1
        out = [entry for entry, _ in self.pending[:n]]
        del self.pending[:n]
        return out

    def finish(self, length: int) -> list[TokenLogprob]:
        """The remaining entries of tokens that begin inside the final text of `length`
        characters; later tokens (a stop string's, the end-of-text token) are dropped."""
        out = [entry for entry, _ in self.pending if entry.start < length]
        self.pending.clear()
        self.closed = True
        return out


def step_logprobs(
    logits: Tensor, ids: Tensor, top_k: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Each row's chosen token's log-prob and its `top_k` most likely `(id, log-prob)`.

    Args:
        logits: `(B, V)` the step's logits.
        ids: `(B,)` the tokens drawn.
        top_k: how many most likely tokens to list (0: none).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    chosen = logp.gather(-1, ids[:, None]).squeeze(-1).tolist()  # (B,)
    if top_k == 0:
        return chosen, [[] for _ in chosen]
    values, top_ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)  # (B, k) each
    pairs = zip(top_ids.tolist(), values.tolist(), strict=True)
    tops = [list(zip(i, v, strict=True)) for i, v in pairs]
    return chosen, tops


def prompt_logprobs(
    model: Any, tokenizer: Tokenizer, ids: list[int], top_k: int
) -> list[TokenLogprob]:
    """The entries of a prompt's tokens (for `echo`): each token's log-prob given the ones
    before it; the first has none.

    Args:
        model: the run's model, in eval mode.
        tokenizer: the run's tokenizer (log-probs cover its ids only).
        ids: the prompt's token ids, at most `context_length`.
        top_k: how many most likely tokens to list.
    """
    texts = TokenTexts(tokenizer)
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits, _ = model(torch.tensor([ids], device=device))  # (1, T, V)
    logits = logits[0, :-1, : tokenizer.vocab_size]  # (T - 1, V): the next token's scores
    chosen, tops = step_logprobs(logits, torch.tensor(ids[1:], device=device), top_k)
    row = RowLogprobs(texts, top_k)
    first_end = texts.end(ids[:1], 0)
    entries = [TokenLogprob(texts.text(ids[0]), None, None, 0)]
    row.ids, row.end = ids[:1], first_end
    for token, logprob, top in zip(ids[1:], chosen, tops, strict=True):
        row.add(token, logprob, top)
    return entries + row.finish(row.end + 1)


def logprobs_json(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """OpenAI's `logprobs` object of a choice (or a chunk), offsets shifted by `offset`."""
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [e.top for e in entries],
        "text_offset": [e.start + offset for e in entries],
    }
