"""Prompts in, `Sample`s out, in batches: the text side of generation that `llmcli sample`,
`llmcli chat` and `llmcli serve` share.

`sample_texts(model, tokenizer, prompts, config, options)` encodes the prompts
(`llmcli.generation.prompts`), generates `options.num_samples` continuations of each in batches
with the settings of a `SampleConfig` (`llmcli.generation.engine`), and turns the new tokens into
text as they come (`llmcli.generation.detokenize`: stop strings and stop ids, multi-byte
characters split over byte tokens), sending it to a `llmcli.generation.streaming.TextSink`; each
`Sample` has its speed. `sample_batch` runs one batch of `SampleJob`s, each with its own seed
(how `llmcli serve` batches requests from several clients).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from torch import Tensor

from llmcli.config import SampleConfig
from llmcli.data.tokenizer import Tokenizer
from llmcli.device import check_threads
from llmcli.errors import InputError
from llmcli.generation.compiled_decode import decode_step
from llmcli.generation.detokenize import TextState
from llmcli.generation.engine import generate
from llmcli.generation.prompts import encode_prompts
from llmcli.generation.sampling import make_generators
from llmcli.generation.streaming import TextSink

logger = logging.getLogger(__name__)

BATCH_SIZE = 64  # most samples generated at once by default


@dataclass
class Sample:
    """One generated sample.

    Attributes:
        prompt: the prompt text as given.
        completion: the generated text (without a stop string that ended it).
        tokens: new tokens generated (including the one that completed a stop string).
        seconds: from the start of its batch to the end of this sample.
        stop_reason: "length" (max_new_tokens reached) or "stop" (a stop string or stop id).
        seed: the seed of its generator (run it alone with this seed for the same text).
        prompt_index, sample_index: which prompt, and which of its `num_samples`.
    """

    prompt: str
    completion: str
    tokens: int
    seconds: float
    stop_reason: Literal["length", "stop"]
    seed: int | None
    prompt_index: int = 0
    sample_index: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON form `llmcli sample --json` prints."""
        return {
            "prompt": self.prompt,
            "completion": self.completion,
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens_per_s, 2),
            "stop_reason": self.stop_reason,
            "seed": self.seed,
            "prompt_index": self.prompt_index,
            "sample_index": self.sample_index,
        }


@dataclass(frozen=True)
class SampleOptions:
    """What `llmcli sample` does around generation besides the sampling settings (those are a
    `llmcli.config.SampleConfig`). Checked as it is made.

    Attributes:
        num_samples: samples per prompt (>= 1).
        stop: a sample ends when its text contains one of these; that text is not part of it.
        stop_ids: a sample ends when it generates one of these ids (not part of its text);
            `sample_run` adds the run's end-of-text id.
        batch_size: most samples generated at once.
        threads: CPU threads while `sample_run` generates (None:
            `llmcli.generation.threads.threads_for` picks).
        weights: the weights `sample_run` loads, "best" or "last" (see
            `llmcli.runs.loading.load_run`).
        device: where `sample_run` runs the model: "auto", "cpu", "cuda" or "mps".
        compile: `sample_texts` decodes with the compiled step
            (`llmcli.generation.compiled_decode`) where it measured faster (`pays`: a small
            model, few rows; elsewhere the default step), compiled first if the cache lacks it.
    """

    num_samples: int = 1
    stop: Sequence[str] = ()
    stop_ids: Sequence[int] = ()
    batch_size: int = BATCH_SIZE
    threads: int | None = None
    weights: str = "best"
    device: str = "auto"
    compile: bool = False

    def __post_init__(self) -> None:
        n = self.num_samples
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InputError(f"--num-samples ({n}) must be an integer >= 1.")
        b = self.batch_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise InputError(f"batch_size ({b}) must be an integer >= 1: the most samples at once.")
        check_threads(self.threads)


class SampleJob(NamedTuple):
    """Sample `r`: the `sample_index`-th continuation of prompt `prompt_index`, drawn from a
    generator seeded `seed` (`sample_texts` seeds sample `r` with `config.seed + r`)."""

    r: int
    prompt_index: int
    sample_index: int
    prompt: str
    ids: list[int]  # the prompt's token ids, cropped to the context
    seed: int


def sample_texts(
    model: Any,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    config: SampleConfig,
    options: SampleOptions = SampleOptions(),
    *,
    sink: TextSink | None = None,
    notify: Callable[[str], Any] = logger.warning,
) -> list[Sample]:
    """Generate `options.num_samples` continuations of every prompt, batched.

    Sample `r = prompt_index * num_samples + sample_index` draws from a generator seeded
    `config.seed + r`, so it is the same text whether it runs in a batch or alone with that
    seed. Up to `options.batch_size` samples run as one left-padded batch.

    Args:
        model: a `Transformer` in eval mode.
        tokenizer: the run's tokenizer.
        prompts: texts; an empty one starts from the tokenizer's start ids.
        config: the sampling settings (see `llmcli.generation.engine.generate`).
        options: samples per prompt, stop strings and ids, batch size, KV cache.
        sink: receives each sample's text as it becomes final (streaming), then `end(r)`.
        notify: receives a one-line notice when prompts are cropped to the context.

    Returns:
        The samples in order `r`.
    """
    if not prompts:
        raise InputError("no prompts given: pass at least one (an empty text is fine)")
    if tokenizer.vocab_size > model.vocab_size:
        raise InputError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{model.vocab_size}: the run's tokenizer.json does not belong to its weights"
        )
    encoded = encode_prompts(tokenizer, prompts, model.context_length, notify)
    n = options.num_samples
    jobs = [
        SampleJob(i * n + j, i, j, prompts[i], encoded[i], config.seed + i * n + j)
        for i in range(len(prompts))
        for j in range(n)
    ]
    rows = min(len(jobs), options.batch_size)  # the largest batch
    if options.compile and decode_step(model, rows) == "auto":  # said once, for every batch
        options = dataclasses.replace(options, compile=False)
    samples: list[Sample] = []
    for first in range(0, len(jobs), options.batch_size):
        batch = jobs[first : first + options.batch_size]
        samples.extend(sample_batch(model, tokenizer, batch, config, options, sink))
    return samples


def sample_batch(
    model: Any,
    tokenizer: Tokenizer,
    batch: Sequence[SampleJob],
    config: SampleConfig,
    options: SampleOptions,
    sink: TextSink | None = None,
    *,
    live: Callable[[int], bool] | None = None,
    observe: Callable[[Tensor, Tensor], Any] | None = None,
) -> list[Sample]:
    """Run the samples `batch` as one left-padded batch: what `sample_texts` runs per batch.

    Each job draws from its own generator seeded `job.seed`, so it gets the text it gets alone
    with that seed whatever else is in the batch (`llmcli serve` batches requests this way).

    Args:
        model, tokenizer: the run's.
        batch: the samples; their prompts' ids already fit the context.
        config: the settings they share (its `seed` is unused: each job has its own).
        options: stop strings and ids, the compiled step (`num_samples` and
            `batch_size` are unused).
        sink: receives each sample's text as it becomes final, under `job.r`, then `end(job.r)`.
        live: checked for every unfinished sample at every step with its `job.r`; a sample
            for which it is False ends there, without more text or `end` (a client gone).
        observe: see `llmcli.generation.engine.generate` (row `b` is `batch[b]`).

    Returns:
        The samples, in the order of `batch`.
    """
    stop_ids = set(options.stop_ids)
    if config.ignore_eos:  # generate past the end-of-text token, which then shows in the text
        stop_ids.discard(getattr(tokenizer, "eot_id", None))
    states = [TextState(tokenizer, options.stop, stop_ids, job.ids) for job in batch]
    vocab = tokenizer.vocab_size if tokenizer.vocab_size < model.vocab_size else None
    start = time.perf_counter()
    steps = generate(
        model,
        [job.ids for job in batch],
        config,
        generators=[make_generators(1, job.seed)[0] for job in batch],
        vocab_size=vocab,
        observe=observe,
        decode=decode_step(model, len(batch)) if options.compile else "auto",
    )
    rows = _Rows(states, [job.r for job in batch], sink, live)
    seconds = _stream(steps, rows, start)
    return [
        Sample(
            prompt=job.prompt,
            completion=state.text,
            tokens=len(state.ids),
            seconds=seconds[b],
            stop_reason=state.stop_reason,
            seed=job.seed,
            prompt_index=job.prompt_index,
            sample_index=job.sample_index,
        )
        for b, (job, state) in enumerate(zip(batch, states, strict=True))
    ]


class _Rows(NamedTuple):
    """The text states of a batch's rows, their indices for `sink`, and `live`."""

    states: list[TextState]
    indices: list[int]
    sink: TextSink | None
    live: Callable[[int], bool] | None

    def push(self, b: int, token: int) -> None:
        """Row `b`'s new token: its text to the sink, or the row ended if it is no longer live."""
        state, index, sink = self.states[b], self.indices[b], self.sink
        if self.live is not None and not self.live(index):
            state.done = True  # its reader is gone: no more text, no end
            return
        piece = state.push(token)
        if sink is not None and piece:
            sink.text(index, piece)
        if state.done and sink is not None:
            sink.end(index)


def _stream(steps: Generator[Tensor, None, None], rows: _Rows, start: float) -> list[float]:
    """Feed each step's tokens to the rows' text states until all are done or the steps end,
    sending the text that becomes final to `rows.sink` under the rows' indices.

    Returns:
        The seconds from `start` (`time.perf_counter`) to the end of each sample.
    """
    states, indices, sink = rows.states, rows.indices, rows.sink
    seconds = [0.0] * len(states)
    remaining = len(states)
    for step in steps:
        now = None
        for b, token in enumerate(step.tolist()):
            if states[b].done:
                continue
            rows.push(b, token)
            if states[b].done:
                now = time.perf_counter() if now is None else now
                seconds[b] = now - start
                remaining -= 1
        if remaining == 0:
            break
    steps.close()
    end = time.perf_counter()
    for b, state in enumerate(states):
        if not state.done:
            piece = state.finish()
            seconds[b] = end - start
            if sink is not None:
                if piece:
                    sink.text(indices[b], piece)
                sink.end(indices[b])
    return seconds
