"""Text around generation: prompts in, `Sample`s out; what `llmcli sample` runs.

`sample_texts(model, tokenizer, prompts, config, options)` encodes the prompts, generates
`options.num_samples` continuations of each in batches with the settings of a `SampleConfig`
(`llmcli.generation.engine`), and turns the new tokens into text as they come: streaming
(`TextSink`, `OrderedWriter` keeps samples generated together in order), stop strings and stop
ids, multi-byte characters split over byte tokens, per-sample speed. `sample_batch` runs one
batch of `SampleJob`s, each with its own seed (how `llmcli serve` batches requests from several
clients). `sample_run` loads a run and applies the command line's settings to its `sample:`
config; `read_prompts` and `unescape` turn the command line's options into prompts and stop
strings.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Literal, NamedTuple, Protocol

import torch
from torch import Tensor

from llmcli.config import SampleConfig
from llmcli.data.tokenizer import CharTokenizer, Tokenizer
from llmcli.device import check_threads, resolve_device
from llmcli.errors import InputError
from llmcli.generation.engine import generate
from llmcli.generation.fast_decode import FastDecoder
from llmcli.generation.prompts import encode_prompt, parse_prompts, read_prompt_file
from llmcli.generation.sampling import make_generators
from llmcli.generation.threads import decode_bound, sampling_threads, torch_threads
from llmcli.model.hooks import HookFn
from llmcli.runs.loading import LoadedRun, load_run

logger = logging.getLogger(__name__)

BATCH_SIZE = 64  # most samples generated at once by default

#: Hook functions made for a loaded model: `model -> {hook point: [function, ...]}`, for
#: `model.hooks` while it generates (`llmcli sample --steer` makes SAE steering ones).
HookFactory = Callable[[Any], Mapping[str, HookFn | list[HookFn]]]


class TextSink(Protocol):
    """Receives the text of samples as it is generated (see `OrderedWriter`)."""

    def text(self, index: int, piece: str) -> None: ...

    def end(self, index: int) -> None: ...


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


class _TextState:
    """One sample's new tokens turned into text, with stop strings held back.

    Text is released only when it can no longer be the start of a stop string, and tokens that
    end inside a multi-byte character (byte-level BPE) wait for the rest of the character.
    New tokens are decoded after a few tokens of context (the prompt's at first), as some
    decoders treat the start of a text specially (SentencePiece drops a leading space).
    """

    # Up to 4 bytes make one UTF-8 character; a byte-level token holds at least one.
    MAX_PENDING = 4
    CONTEXT = 4

    def __init__(
        self,
        tokenizer: Tokenizer,
        stops: Sequence[str],
        stop_ids: set[int],
        context: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        # A char tokenizer's token is its text alone: no context, no partial characters.
        self.token_texts = tokenizer.token_texts if isinstance(tokenizer, CharTokenizer) else None
        self.stops = [s for s in stops if s]
        self.stop_ids = stop_ids
        self.context = list(context)[-self.CONTEXT :]
        self.ids: list[int] = []
        self.decoded = 0  # ids[:decoded] are in `text`
        self.text = ""
        self.emitted = 0  # text[:emitted] has been released
        self.done = False
        self.stop_reason: Literal["length", "stop"] = "length"

    def push(self, token: int) -> str:
        """Add one token; returns the text that is now final."""
        self.ids.append(token)
        if token in self.stop_ids:
            self.done, self.stop_reason = True, "stop"
            return self.finish(include_last=False)
        piece = self._decode(len(self.ids))
        if piece.endswith("\ufffd") and len(self.ids) - self.decoded < self.MAX_PENDING:
            return ""
        self.decoded = len(self.ids)
        return self._add(piece)

    def _decode(self, upto: int) -> str:
        """The text of `ids[decoded:upto]`, decoded after up to CONTEXT earlier tokens."""
        new = self.ids[self.decoded : upto]
        if self.token_texts is not None:
            return "".join([self.token_texts[i] for i in new])
        n = self.CONTEXT
        if self.decoded >= n:
            ctx = self.ids[self.decoded - n : self.decoded]
        else:
            ctx = self.context[max(0, len(self.context) - (n - self.decoded)) :]
            ctx = ctx + self.ids[: self.decoded]
        if not ctx:
            return self.tokenizer.decode(new)
        base = self.tokenizer.decode(ctx)
        full = self.tokenizer.decode(ctx + new)
        return full[len(base) :] if full.startswith(base) else self.tokenizer.decode(new)

    def _add(self, piece: str) -> str:
        self.text += piece
        if self.stops:
            hits = [i for i in (self.text.find(s, self.emitted) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.done, self.stop_reason = True, "stop"
                return self._release(len(self.text))
            return self._release(len(self.text) - self._held())
        return self._release(len(self.text))

    def _held(self) -> int:
        """Length of the longest end of `text` that could begin a stop string."""
        tail = self.text[self.emitted :]
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, upto: int) -> str:
        out = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return out

    def finish(self, include_last: bool = True) -> str:
        """End the sample: decode what is pending and release everything held back."""
        stop = len(self.ids) if include_last else len(self.ids) - 1
        if self.decoded < stop:
            self.text += self._decode(stop)
            self.decoded = stop
        self.done = True
        return self._release(len(self.text))


class OrderedWriter:
    """Writes samples generated together as if one came after another.

    Sample 0 is written as its text arrives; the others are buffered until every sample before
    them has ended. Each sample is its header (the prompt), its text and a newline if the text
    does not end with one; `separator` goes between samples.

    Args:
        write: called with each piece of output (for example `sys.stdout.write` + flush).
        headers: one per sample, written before its text.
        separator: a line written between samples.
    """

    def __init__(
        self, write: Callable[[str], Any], headers: Sequence[str], separator: str = "-" * 15
    ) -> None:
        self.write = write
        self.headers = list(headers)
        self.separator = separator
        self.current = -1
        self.buffers: dict[int, list[str]] = {i: [] for i in range(len(self.headers))}
        self.ended: set[int] = set()
        self.last_char = "\n"
        self._advance()

    def _out(self, text: str) -> None:
        if text:
            self.write(text)
            self.last_char = text[-1]

    def _advance(self) -> None:
        """Move on to the next sample, writing what it buffered, as far as samples have ended."""
        while True:
            if self.current >= 0:
                if self.last_char != "\n":
                    self._out("\n")
                if self.current + 1 < len(self.headers):
                    self._out(self.separator + "\n")
            self.current += 1
            if self.current >= len(self.headers):
                return
            self._out(self.headers[self.current])
            self._out("".join(self.buffers.pop(self.current)))
            if self.current not in self.ended:
                return

    def text(self, index: int, piece: str) -> None:
        if index == self.current:
            self._out(piece)
        elif piece:
            self.buffers[index].append(piece)

    def end(self, index: int) -> None:
        self.ended.add(index)
        if index == self.current:
            self._advance()


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
        use_cache: use the KV cache (see `llmcli.generation.engine.generate`).
        threads: CPU threads while `sample_run` generates (None: `threads_for` picks).
        weights: the weights `sample_run` loads, "best" or "last" (see
            `llmcli.runs.loading.load_run`).
        device: where `sample_run` runs the model: "auto", "cpu", "cuda" or "mps".
    """

    num_samples: int = 1
    stop: Sequence[str] = ()
    stop_ids: Sequence[int] = ()
    batch_size: int = BATCH_SIZE
    use_cache: bool = True
    threads: int | None = None
    weights: str = "best"
    device: str = "auto"

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
    C = model.context_length
    encoded = [encode_prompt(tokenizer, p, C) for p in prompts]
    cropped = [i for i, (_, was_cropped) in enumerate(encoded) if was_cropped]
    _notify_cropped(cropped, len(prompts), C, notify)
    n = options.num_samples
    jobs = [
        SampleJob(i * n + j, i, j, prompts[i], encoded[i][0], config.seed + i * n + j)
        for i in range(len(prompts))
        for j in range(n)
    ]
    samples: list[Sample] = []
    for first in range(0, len(jobs), options.batch_size):
        batch = jobs[first : first + options.batch_size]
        samples.extend(sample_batch(model, tokenizer, batch, config, options, sink))
    return samples


def _notify_cropped(
    cropped: list[int], n_prompts: int, C: int, notify: Callable[[str], Any]
) -> None:
    """One notice for the prompts (indices `cropped`) longer than the context, if any."""
    if len(cropped) == 1 and n_prompts == 1:
        notify(
            f"the prompt is longer than the model's context_length ({C} tokens): the model "
            f"sees only its last {C} tokens."
        )
    elif cropped:
        shown = ", ".join(str(i) for i in cropped[:5]) + (", ..." if len(cropped) > 5 else "")
        notify(
            f"{len(cropped)} prompts (index {shown}) are longer than the model's "
            f"context_length ({C} tokens): the model sees only the last {C} tokens of each."
        )


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
        options: stop strings and ids, KV cache (`num_samples` and `batch_size` are unused).
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
    states = [_TextState(tokenizer, options.stop, stop_ids, job.ids) for job in batch]
    vocab = tokenizer.vocab_size if tokenizer.vocab_size < model.vocab_size else None
    start = time.perf_counter()
    steps = generate(
        model,
        [job.ids for job in batch],
        config,
        generators=[make_generators(1, job.seed)[0] for job in batch],
        use_cache=options.use_cache,
        vocab_size=vocab,
        observe=observe,
        decode=FastDecoder.for_model(model),
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

    states: list[_TextState]
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


def format_samples(samples: Sequence[Sample], separator: str = "-" * 15) -> str:
    """The plain-text output of `llmcli sample`: each prompt + completion, separator between."""
    out: list[str] = []
    writer = OrderedWriter(out.append, [s.prompt for s in samples], separator)
    for i, s in enumerate(samples):
        writer.text(i, s.completion)
        writer.end(i)
    return "".join(out)


# ----------------------------------------------------------------------------- a run


def read_prompts(
    prompt: str | None, prompt_file: str | Path | None, stdin: IO[str] | None = None
) -> list[str]:
    """The prompts of `llmcli sample`: `--prompt TEXT`, `--prompt -` (stdin), `--prompt-file`.

    A prompt file holds one prompt per line (empty lines are skipped), or a JSON list of strings
    (a `.json` file must be one; another file is read as JSON when it parses as such a list);
    see `llmcli.generation.prompts.parse_prompts`. `--prompt-file -` reads it from stdin. With
    neither option there is one empty prompt.

    Raises:
        InputError: both options, an unreadable or empty file, a JSON file of the wrong shape.
    """
    if prompt is not None and prompt_file is not None:
        raise InputError("give either --prompt or --prompt-file, not both.")
    stdin = sys.stdin if stdin is None else stdin
    if prompt == "-":
        return [stdin.read()]
    if prompt is not None:
        return [prompt]
    if prompt_file is None:
        return [""]
    if str(prompt_file) == "-":
        return parse_prompts(stdin.read(), "-")
    return read_prompt_file(prompt_file)


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """Turn the escapes `\\n`, `\\t`, `\\r` and `\\\\` typed on a command line into the characters;
    any other backslash is kept as is (so `--stop '\\n\\n'` stops at a blank line)."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), text)


def sample_run(
    checkpoint: str | Path | None,
    prompts: Sequence[str],
    overrides: Mapping[str, Any] | None = None,
    options: SampleOptions = SampleOptions(),
    *,
    hooks: HookFactory | None = None,
    write: Callable[[str], Any] | None = None,
    notify: Callable[[str], Any] = logger.warning,
) -> list[Sample]:
    """Load a run and sample from it: what `llmcli sample` does.

    The sampling settings are the run's `sample:` config with `overrides` applied by
    `dataclasses.replace`, which checks them. A sample also ends at the end-of-text token,
    unless `sample.ignore_eos` is set.

    Args:
        checkpoint: a run directory (or a weights file in one); None = the latest run under
            `checkpoints/`.
        prompts: texts; each gets `options.num_samples` samples, all generated as one batch.
        overrides: sampling settings by `SampleConfig` key (`{"temperature": 0.0}`), over the
            run's.
        options: the rest: samples per prompt, stop strings, CPU threads, which weights, the
            device (see `SampleOptions`).
        hooks: makes the hook functions to run while sampling from the loaded model (called once
            the run is loaded, before any sample; its errors propagate), or None.
        write: receives the formatted output as it is generated (`OrderedWriter`), or None.
        notify: receives one-line notices (which run is used, version differences).

    Returns:
        The samples, prompt by prompt.
    """
    run, config, options = load_for_sampling(checkpoint, overrides, options, notify)
    headers = [p for p in prompts for _ in range(options.num_samples)]
    sink = None if write is None else OrderedWriter(write, headers)
    threads = sample_threads(run.model, config, options)
    with torch_threads(threads), hooked(run.model, hooks):
        return sample_texts(
            run.model, run.tokenizer, prompts, config, options, sink=sink, notify=notify
        )


def hooked(model: Any, hooks: HookFactory | None) -> AbstractContextManager[None]:
    """`model.hooks` with the functions `hooks` makes for `model` while the block runs (with
    None, nothing changes). Any hook function at work makes each step a full forward."""
    return nullcontext() if hooks is None else model.hooks(hooks(model))


def load_for_sampling(
    checkpoint: str | Path | None,
    overrides: Mapping[str, Any] | None,
    options: SampleOptions,
    notify: Callable[[str], Any] = logger.warning,
) -> tuple[LoadedRun, SampleConfig, SampleOptions]:
    """Load a run to sample from, as `sample_run` does: the run, its `sample:` config with
    `overrides` applied (checked before the run loads, `context_keep` against its model), and
    `options` with the run's end-of-text id added to the stop ids."""
    overrides = dict(overrides or {})
    SampleConfig(**overrides)  # a mistyped setting fails at once, before the run loads
    device = resolve_device(options.device, what="--device")
    run = load_run(checkpoint, weights=options.weights, device=device, notify=notify)
    config = replace(run.config.sample, **overrides)
    # context_keep depends on the model: checked before any output (generate checks it again,
    # for callers that bring a model alone).
    config.keep_for(run.model.context_length)
    if overrides.get("context_keep") is not None and config.context_policy == "exact":
        notify("--context-keep is for the shift policy; exact keeps the last context_length tokens")
    eot = run.tokenizer.eot_id
    if eot is not None:
        options = replace(options, stop_ids=(*options.stop_ids, eot))
    return run, config, options


def sample_threads(model: Any, config: SampleConfig, options: SampleOptions) -> int | None:
    """The CPU threads to sample with: `options.threads`, else `threads_for`."""
    if options.threads is not None:
        return options.threads
    return threads_for(model, next(model.parameters()).device, config)


def threads_for(model: Any, device: torch.device, config: SampleConfig) -> int | None:
    """CPU threads for a sample (`threads.sampling_threads`): 1 for a small model whose steps
    are mostly decode steps (`threads.decode_bound`), else torch's own count."""
    return sampling_threads(model, device, decode_bound(config, model.context_length))
