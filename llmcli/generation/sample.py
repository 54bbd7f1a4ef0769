"""Text around generation: prompts in, `Sample`s out; what `llmcli sample` runs.

`sample_texts(model, tokenizer, prompts, ...)` encodes the prompts, generates `num_samples`
continuations of each in batches (`llmcli.generation.generate`), and turns the new tokens into text
as they come: streaming (`TextSink`, `OrderedWriter` keeps samples generated together in order),
stop strings and stop ids, multi-byte characters split over byte tokens, per-sample speed.
`sample_run` loads a run and applies its `sample:` defaults; `read_prompts` and `unescape` turn
the command line's options into prompts and stop strings.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, Protocol

import torch

from llmcli.config import SampleConfig
from llmcli.data.tokenizer import CharTokenizer, Tokenizer
from llmcli.device import resolve_device, sampling_threads, torch_threads
from llmcli.errors import InputError
from llmcli.generation.context_window import check_context_policy, check_policy_name
from llmcli.generation.generate import generate
from llmcli.generation.prompts import encode_prompt, parse_prompts, read_prompt_file
from llmcli.generation.sampling import check_sampling, make_generators
from llmcli.runs.checkpoint import load_run

logger = logging.getLogger(__name__)

BATCH_SIZE = 64  # most samples generated at once by default


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


def sample_texts(
    model: Any,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int | None = None,
    num_samples: int = 1,
    stop: Sequence[str] = (),
    stop_ids: Sequence[int] = (),
    use_cache: bool = True,
    context_policy: str = "shift",
    context_keep: int | None = None,
    sink: TextSink | None = None,
    batch_size: int = BATCH_SIZE,
    notify: Callable[[str], Any] = logger.warning,
) -> list[Sample]:
    """Generate `num_samples` continuations of every prompt, batched.

    Sample `r = prompt_index * num_samples + sample_index` draws from a generator seeded
    `seed + r`, so it is the same text whether it runs in a batch or alone with that seed. Up to
    `batch_size` samples run as one left-padded batch.

    Args:
        model: a `Transformer` in eval mode.
        tokenizer: the run's tokenizer.
        prompts: texts; an empty one starts from the tokenizer's start ids.
        max_new_tokens: tokens to generate per sample at most (>= 1).
        temperature, top_k, top_p: see `llmcli.generation.sampling.sample_next`.
        seed: base seed (a fresh random one when None).
        num_samples: samples per prompt (>= 1).
        stop: a sample ends when its text contains one of these; that text is not part of it.
        stop_ids: a sample ends when it generates one of these ids (not part of its text).
        use_cache: use the KV cache (see `llmcli.generation.generate.generate`).
        context_policy, context_keep: what the model sees past its context, "exact" or
            "shift" and the tokens `shift` keeps (see `llmcli.generation.generate.generate`).
        sink: receives each sample's text as it becomes final (streaming), then `end(r)`.
        batch_size: most samples generated at once.
        notify: receives a one-line notice when prompts are cropped to the context.

    Returns:
        The samples in order `r`.
    """
    check_sampling(temperature, top_k, top_p)
    keep = check_context_policy(context_policy, context_keep, model.context_length)
    return _sample_texts(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        num_samples=num_samples,
        stop=stop,
        stop_ids=stop_ids,
        use_cache=use_cache,
        context_policy=context_policy,
        context_keep=keep,
        sink=sink,
        batch_size=batch_size,
        notify=notify,
    )


def _sample_texts(
    model: Any,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float,
    seed: int | None,
    num_samples: int,
    stop: Sequence[str],
    stop_ids: Sequence[int],
    use_cache: bool,
    context_policy: str,
    context_keep: int,
    sink: TextSink | None,
    batch_size: int,
    notify: Callable[[str], Any],
) -> list[Sample]:
    """`sample_texts` trusting its sampling controls and context policy (`context_keep`
    resolved), which the caller has checked once."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens ({max_new_tokens}) must be an integer >= 1")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise InputError(f"num_samples ({num_samples}) must be an integer >= 1")
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
    if len(cropped) == 1 and len(prompts) == 1:
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
    if seed is None:
        seed = int(torch.Generator().seed()) % (2**62)
    jobs = [(i, j) for i in range(len(prompts)) for j in range(num_samples)]
    samples: list[Sample] = []
    for first in range(0, len(jobs), batch_size):
        chunk = list(range(first, min(first + batch_size, len(jobs))))
        samples.extend(
            _sample_batch(
                model,
                tokenizer,
                prompts,
                encoded,
                jobs,
                chunk,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                stop=stop,
                stop_ids=set(stop_ids),
                use_cache=use_cache,
                context_policy=context_policy,
                context_keep=context_keep,
                sink=sink,
            )
        )
    return samples


def _sample_batch(
    model: Any,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    encoded: list[tuple[list[int], bool]],
    jobs: list[tuple[int, int]],
    chunk: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float,
    seed: int,
    stop: Sequence[str],
    stop_ids: set[int],
    use_cache: bool,
    context_policy: str,
    context_keep: int,
    sink: TextSink | None,
) -> list[Sample]:
    """Run the samples `chunk` (indices into `jobs`) as one batch."""
    states = [_TextState(tokenizer, stop, stop_ids, encoded[jobs[r][0]][0]) for r in chunk]
    seconds = [0.0] * len(chunk)
    vocab = tokenizer.vocab_size if tokenizer.vocab_size < model.vocab_size else None
    start = time.perf_counter()
    config = SampleConfig(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        context_policy=context_policy,
        context_keep=context_keep,
    )
    steps = generate(
        model,
        [encoded[jobs[r][0]][0] for r in chunk],
        config,
        generators=make_generators(len(chunk), seed + chunk[0]),
        use_cache=use_cache,
        vocab_size=vocab,
    )
    live = len(chunk)
    for step in steps:
        now = None
        for b, token in enumerate(step.tolist()):
            state = states[b]
            if state.done:
                continue
            piece = state.push(token)
            if sink is not None and piece:
                sink.text(chunk[b], piece)
            if state.done:
                now = time.perf_counter() if now is None else now
                seconds[b] = now - start
                live -= 1
                if sink is not None:
                    sink.end(chunk[b])
        if live == 0:
            break
    steps.close()
    end = time.perf_counter()
    for b, state in enumerate(states):
        if not state.done:
            piece = state.finish()
            seconds[b] = end - start
            if sink is not None:
                if piece:
                    sink.text(chunk[b], piece)
                sink.end(chunk[b])
    return [
        Sample(
            prompt=prompts[jobs[r][0]],
            completion=state.text,
            tokens=len(state.ids),
            seconds=seconds[b],
            stop_reason=state.stop_reason,
            seed=seed + r,
            prompt_index=jobs[r][0],
            sample_index=jobs[r][1],
        )
        for b, (r, state) in enumerate(zip(chunk, states, strict=True))
    ]


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
    *,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    num_samples: int = 1,
    stop: Sequence[str] = (),
    context_policy: str | None = None,
    context_keep: int | None = None,
    threads: int | None = None,
    weights: str = "best",
    device: str = "auto",
    write: Callable[[str], Any] | None = None,
    notify: Callable[[str], Any] = logger.warning,
) -> list[Sample]:
    """Load a run and sample from it: what `llmcli sample` does.

    Settings left None come from the run's `sample:` config. A BPE run's samples also end at the
    end-of-text token.

    Args:
        checkpoint: a run directory (or a weights file in one); None = the latest run under
            `checkpoints/`.
        prompts: texts; each gets `num_samples` samples, all generated as one batch.
        max_new_tokens, temperature, top_k, top_p, seed: override the run's defaults.
        num_samples: samples per prompt.
        stop: stop strings (see `sample_texts`).
        context_policy, context_keep: override the run's `sample.context_policy` and
            `sample.context_keep` (see `llmcli.generation.generate.generate`).
        threads: CPU threads while generating (None: picked by `device.sampling_threads`).
        weights: "best" or "last" weights of the run (see `checkpoint.load_run`).
        device: "auto", "cpu", "cuda" or "mps".
        write: receives the formatted output as it is generated (`OrderedWriter`), or None.
        notify: receives one-line notices (which run is used, version differences).

    Returns:
        The samples, prompt by prompt.
    """
    # The options are checked before the run loads, so that a mistyped one fails at once.
    _check_options(temperature, top_k, top_p, max_new_tokens, num_samples, context_policy, threads)
    device_ = resolve_device(device, what="--device")
    run = load_run(checkpoint, weights=weights, device=device_, notify=notify)
    defaults = run.config.sample
    policy = defaults.context_policy if context_policy is None else context_policy
    keep = check_context_policy(
        policy,
        defaults.context_keep if context_keep is None else context_keep,
        run.model.context_length,
        names=("--context-policy", "--context-keep"),
    )
    if context_keep is not None and policy == "exact" and notify is not None:
        notify("--context-keep is for the shift policy; exact keeps the last context_length tokens")
    eot = run.tokenizer.eot_id
    headers = [p for p in prompts for _ in range(num_samples)]
    new_tokens = defaults.max_new_tokens if max_new_tokens is None else max_new_tokens
    threads = threads_for(run.model, device_, policy, new_tokens) if threads is None else threads
    # The run's defaults were checked when its config loaded, the options above: trust both.
    with torch_threads(threads):
        return _sample_texts(
            run.model,
            run.tokenizer,
            prompts,
            max_new_tokens=new_tokens,
            temperature=defaults.temperature if temperature is None else temperature,
            top_k=defaults.top_k if top_k is None else top_k,
            top_p=defaults.top_p if top_p is None else top_p,
            seed=defaults.seed if seed is None else seed,
            num_samples=num_samples,
            stop=stop,
            stop_ids=() if eot is None else (eot,),
            use_cache=True,
            context_policy=policy,
            context_keep=keep,
            sink=None if write is None else OrderedWriter(write, headers),
            batch_size=BATCH_SIZE,
            notify=notify,
        )


def _check_options(
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    max_new_tokens: int | None,
    num_samples: int,
    context_policy: str | None,
    threads: int | None,
) -> None:
    """Raise `InputError` for a `sample_run` option out of range, naming the command-line
    option; a setting left to the run's default (None) is checked with a value that passes."""
    check_sampling(
        0.0 if temperature is None else temperature, top_k, 1.0 if top_p is None else top_p
    )
    if max_new_tokens is not None and max_new_tokens < 1:
        raise InputError(f"--max-new-tokens ({max_new_tokens}) must be >= 1.")
    if num_samples < 1:
        raise InputError(f"--num-samples ({num_samples}) must be >= 1.")
    if context_policy is not None:
        check_policy_name(context_policy, "--context-policy")
    cpus = os.cpu_count() or 1
    if threads is not None and not 1 <= threads <= cpus:  # torch crashes on absurd counts
        raise InputError(f"--threads ({threads}) must be in 1..{cpus} (this machine's CPUs).")


def threads_for(model: Any, device: torch.device, policy: str, new_tokens: int) -> int | None:
    """CPU threads for a sample (`device.sampling_threads`): its steps are decode-bound under
    `shift`, or under `exact` when they all fit in the context."""
    decode_bound = policy == "shift" or new_tokens < model.context_length
    return sampling_threads(model, device, decode_bound)
