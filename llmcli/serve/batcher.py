"""Requests that arrive together, generated as one padded batch on one generation thread.

The server's request handlers `submit` a `Work` (a checked request and its prompts' ids) and read
its `Event`s. The generation thread takes the oldest waiting request, waits `wait_s` for more when
nothing else is waiting, and runs every waiting request that shares its settings
(`CompletionRequest.batch_key`: all but the seed, and the stop strings and ids), up to `max_rows`
rows, through `llmcli.generation.batching.sample_batch`. Each row draws from its own generator
seeded with its request's seed + its choice index, so a request's text is the text `llmcli sample`
gives with the same settings and seed, whatever it is batched with. A request whose client went
away is `cancel`led: its rows end at the next step, and a batch of only such rows stops.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import Tensor

from llmcli.data.tokenizer import Tokenizer
from llmcli.generation.batching import Sample, SampleJob, SampleOptions, sample_batch
from llmcli.generation.threads import threads_for, torch_threads
from llmcli.serve.logprobs import (
    RowLogprobs,
    TokenLogprob,
    TokenTexts,
    prompt_logprobs,
    step_logprobs,
)
from llmcli.serve.request import CompletionRequest
from llmcli.serve.response import APIError

logger = logging.getLogger(__name__)


class Text(NamedTuple):
    """New text of choice `index`, with its tokens' log-probs when the request asked."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None


class End(NamedTuple):
    """Choice `index` has ended: "stop" (a stop string or end of text) or "length"."""

    index: int
    finish_reason: str
    tokens: int


class Echo(NamedTuple):
    """The log-probs of prompt `prompt_index`'s tokens (for `echo` with `logprobs`)."""

    prompt_index: int
    logprobs: list[TokenLogprob]


class Done(NamedTuple):
    """The request is answered; `failed` says why not, if it is not."""

    failed: APIError | None = None


Event = Text | End | Echo | Done


@dataclass
class Work:
    """One request as the generation thread sees it.

    Attributes:
        request: the checked request.
        ids: each prompt's token ids (they fit the context).
        deliver: called on the generation thread with the next `Event`s, in order; it must not
            block. A streaming request gets its events step by step, another one when all its
            choices have ended.
    """

    request: CompletionRequest
    ids: list[list[int]]
    deliver: Callable[[list[Event]], Any]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """The client is gone: end this request's rows at the next step."""
        self.cancelled.set()


@dataclass
class Stats:
    """What the generation thread has done (`GET /health` shows it): requests and rows run,
    batches, new tokens, and requests whose client went away (`cancelled`)."""

    requests: int = 0
    batches: int = 0
    rows: int = 0
    largest_batch: int = 0
    tokens: int = 0
    cancelled: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Batcher:
    """The generation thread and its queue of requests.

    Args:
        model, tokenizer: the run's (the model in eval mode).
        max_rows: the most rows generated as one batch (a request has at most this many).
        wait_s: how long a lone request waits for others to batch with.
    """

    def __init__(self, model: Any, tokenizer: Tokenizer, max_rows: int, wait_s: float) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_rows = max_rows
        self.wait_s = wait_s
        self.texts = TokenTexts(tokenizer)
        self.stats = Stats()
        eot = tokenizer.eot_id
        self.stop_ids = () if eot is None else (eot,)
        self._queue: queue.Queue[Work | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="llmcli-generation", daemon=True)
        self._device = next(model.parameters()).device

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread after the batch it is running."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    def submit(self, work: Work) -> None:
        if work.request.rows > self.max_rows:
            raise ValueError(f"a request of {work.request.rows} rows > max_rows {self.max_rows}")
        self._queue.put(work)

    def waiting(self) -> int:
        return self._queue.qsize()

    def _loop(self) -> None:
        pending: list[Work] = []
        while True:
            if not pending:
                first = self._queue.get()
                if first is None:
                    return
                pending.append(first)
                closing = self._collect(pending, time.monotonic() + self.wait_s)
            else:
                closing = self._collect(pending, 0.0)
            live = [w for w in pending if not w.cancelled.is_set()]
            self.stats.cancelled += len(pending) - len(live)
            for work in pending:
                if work.cancelled.is_set():
                    work.deliver([Done()])
            batch, pending = _take_batch(live, self.max_rows)
            if batch:
                self._run(batch)
            if closing:
                for work in pending:
                    work.deliver([Done(APIError(503, "the server is shutting down."))])
                return

    def _collect(self, pending: list[Work], deadline: float) -> bool:
        """Move waiting requests into `pending` until `deadline` (`time.monotonic`; past: only
        those already waiting) or until `max_rows` rows wait; True when the server closes."""
        while sum(w.request.rows for w in pending) < self.max_rows:
            timeout = deadline - time.monotonic()
            try:
                work = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                return False
            if work is None:
                return True
            pending.append(work)
        return False

    def _run(self, batch: list[Work]) -> None:
        self.stats.requests += len(batch)
        self.stats.batches += 1
        try:
            self._generate(batch)
        except Exception as exc:  # the server goes on; these requests fail
            logger.exception("generation failed")
            error = APIError(500, f"generation failed: {exc}", kind="server_error")
            for work in batch:
                work.deliver([Done(error)])
            return
        for work in batch:
            work.deliver([Done()])

    def _generate(self, batch: list[Work]) -> None:
        """Run `batch` (requests of one `batch_key`) as one padded batch."""
        rows = _BatchRows(batch, self.texts)
        for work in batch:
            self._echo_logprobs(work)
        first = batch[0].request
        options = SampleOptions(stop=first.stop, stop_ids=(*self.stop_ids, *first.stop_ids))
        config = first.config
        threads = threads_for(self.model, self._device, config)
        with torch_threads(threads):
            samples = sample_batch(
                self.model,
                self.tokenizer,
                rows.jobs,
                config,
                options,
                rows,
                live=rows.live,
                observe=rows.observe,
            )
        rows.finish(samples)
        self.stats.rows += len(rows.jobs)
        self.stats.largest_batch = max(self.stats.largest_batch, len(rows.jobs))
        self.stats.tokens += sum(s.tokens for s in samples)
        self.stats.cancelled += sum(work.cancelled.is_set() for work in batch)

    def _echo_logprobs(self, work: Work) -> None:
        request = work.request
        if not (request.echo and request.logprobs is not None):
            return
        for i, (prompt, ids) in enumerate(zip(request.prompts, work.ids, strict=True)):
            entries = (
                []
                if prompt == ""
                else prompt_logprobs(self.model, self.tokenizer, ids, request.logprobs)
            )
            work.deliver([Echo(i, entries)])


def _take_batch(pending: list[Work], max_rows: int) -> tuple[list[Work], list[Work]]:
    """The oldest request and those after it with its `batch_key`, up to `max_rows` rows;
    and the requests left waiting, in order."""
    if not pending:
        return [], []
    key = pending[0].request.batch_key()
    batch, rest, rows = [], [], 0
    for work in pending:
        if work.request.batch_key() == key and rows + work.request.rows <= max_rows:
            batch.append(work)
            rows += work.request.rows
        else:
            rest.append(work)
    return batch, rest


class _BatchRows:
    """The rows of one batch: who owns each, their log-probs, and the sink `sample_batch`
    sends their text to.

    Row `r` is choice `choice[r]` of request `batch[owner[r]]`, and its generator is seeded with
    the request's seed + that choice index, as `llmcli sample` seeds sample `r`. Events wait in
    an outbox per request, sent once per step (a stream) or when all its choices have ended.
    """

    def __init__(self, batch: list[Work], texts: TokenTexts) -> None:
        self.batch = batch
        self.jobs: list[SampleJob] = []
        self.owner: list[int] = []
        self.choice: list[int] = []
        self.logprobs: list[RowLogprobs | None] = []
        for w, work in enumerate(batch):
            request = work.request
            for i, (prompt, ids) in enumerate(zip(request.prompts, work.ids, strict=True)):
                for j in range(request.n):
                    c = i * request.n + j
                    seed = request.config.seed + c
                    self.jobs.append(SampleJob(len(self.jobs), i, j, prompt, ids, seed))
                    self.owner.append(w)
                    self.choice.append(c)
                    k = request.logprobs
                    self.logprobs.append(None if k is None else RowLogprobs(texts, k))
        self.wants_logprobs = any(lp is not None for lp in self.logprobs)
        self.top_k = max((lp.top_k for lp in self.logprobs if lp is not None), default=0)
        self.lengths = [0] * len(self.jobs)  # characters of text sent
        self.steps = 0
        self.max_steps = batch[0].request.config.max_new_tokens
        self.ended = [False] * len(self.jobs)
        self.open = [work.request.rows for work in batch]  # choices not yet ended
        self.outbox: list[list[Event]] = [[] for _ in batch]

    def live(self, r: int) -> bool:
        return not self.batch[self.owner[r]].cancelled.is_set()

    def observe(self, logits: Tensor, ids: Tensor) -> None:
        self.flush()  # the previous step's events
        self.steps += 1
        if not self.wants_logprobs:
            return
        chosen, tops = step_logprobs(logits, ids, self.top_k)
        tokens = ids.tolist()
        for r, row in enumerate(self.logprobs):
            if row is not None:
                row.add(tokens[r], chosen[r], tops[r])

    def flush(self) -> None:
        """Send the events waiting for streams, and for requests whose choices all ended."""
        for w, events in enumerate(self.outbox):
            if events and (self.batch[w].request.stream or self.open[w] == 0):
                self.batch[w].deliver(events)
                self.outbox[w] = []

    def text(self, r: int, piece: str) -> None:
        self.lengths[r] += len(piece)
        row = self.logprobs[r]
        entries = None if row is None else row.release(self.lengths[r])
        self.outbox[self.owner[r]].append(Text(self.choice[r], piece, entries))

    def end(self, r: int) -> None:
        # Before the last step only a stop ends a row; at the last step `finish` knows which.
        if self.steps < self.max_steps:
            self._end(r, "stop", self.steps)

    def _end(self, r: int, reason: str, tokens: int) -> None:
        self.ended[r] = True
        w = self.owner[r]
        row = self.logprobs[r]
        if row is not None:
            entries = row.finish(self.lengths[r])
            if entries:
                self.outbox[w].append(Text(self.choice[r], "", entries))
        self.outbox[w].append(End(self.choice[r], reason, tokens))
        self.open[w] -= 1

    def finish(self, samples: list[Sample]) -> None:
        """End the rows still open when the batch is done, with their samples' reasons, and
        send every event left."""
        for r, sample in enumerate(samples):
            if not self.ended[r] and self.live(r):
                self._end(r, sample.stop_reason, sample.tokens)
        for w, events in enumerate(self.outbox):
            if events:
                self.batch[w].deliver(events)
        self.outbox = [[] for _ in self.batch]
