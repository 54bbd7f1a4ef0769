"""Measuring `llmcli bench`: speed and memory of a config across head counts and lengths.

For every `(n_head, context_length)` combination the config's model is rebuilt with those two
values (everything else as the config says) and measured on random tokens:

- training tokens/s: the training step of `llmcli.training.loop` (forward and loss under the run's
  precision, backward, gradient clipping, `llmcli.training.optim.build_optimizer`'s optimizer,
  zero_grad) at `train.batch_size` sequences of `context_length` tokens, after one warm-up step;
- sampling tokens/s: `llmcli.generation.engine.generate` (KV cache, temperature 1, batch 1) from a
  one-token prompt, `min(sample_tokens, context_length - 1)` new tokens, so that the cache never
  slides;
- forward latency: the median time of an eval-mode forward of one full-length sequence (1 x T);
- peak memory: on CUDA `torch.cuda.max_memory_allocated` over the whole measurement; on the CPU
  the process's peak resident set size (`ru_maxrss`), together with its growth over the RSS the
  process had before the model was built (the interpreter and torch themselves take a few
  hundred MB).

Peak RSS only grows within a process, so by default every combination runs in a fresh
subprocess (`isolate=True`); in-process runs (`isolate=False`, quicker, for tests) report the
CUDA figures but no CPU memory. Combinations the model cannot have (`n_embed` not divisible by
`n_head`, an odd head size with rotary embeddings) are listed as invalid with the reason instead
of being run. Results come back as `BenchResult`s, which `llmcli.bench.report` writes down.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import statistics
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmcli.config import Config, ModelConfig, SampleConfig
from llmcli.data.tokenizer import load_tokenizer
from llmcli.device import resolve_device, timed
from llmcli.errors import ConfigError, InputError
from llmcli.generation.engine import generate
from llmcli.model.gpt import Transformer
from llmcli.progress import Progress, peak_rss_bytes
from llmcli.training.plan import SameBatch
from llmcli.training.precision import Precision
from llmcli.training.step import make_trainer, train_step

logger = logging.getLogger(__name__)

DEFAULT_HEADS = (1, 2, 4, 8)
DEFAULT_SEQS = (64, 128, 256, 512)


@dataclass
class BenchResult:
    """The measurements of one `(n_head, context_length)` combination.

    `status` is "ok", "invalid" (the model cannot have this shape; `message` says why) or
    "error" (the measurement failed, for example out of memory; `message` has the error).
    Speeds and memory are None unless the status is "ok" (CPU memory also without isolation).
    """

    n_head: int
    context_length: int
    status: str = "ok"
    message: str = ""
    head_size: int | None = None
    n_params: int | None = None
    train_tokens_per_s: float | None = None
    sample_tokens_per_s: float | None = None
    forward_ms: float | None = None
    peak_memory_mb: float | None = None
    memory_growth_mb: float | None = None
    memory_kind: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class BenchSettings:
    """How much work each combination does (the defaults keep a run to about a minute)."""

    train_steps: int = 3
    sample_tokens: int = 64
    forward_reps: int = 3
    vocab_size: int | None = None  # None: see `vocab_size_for`
    seed: int = 0

    def validate(self) -> None:
        for key in ("train_steps", "sample_tokens", "forward_reps"):
            if getattr(self, key) < 1:
                raise InputError(
                    f"bench {key.replace('_', '-')} ({getattr(self, key)}) must be at least 1."
                )
        if self.vocab_size is not None and self.vocab_size < 2:
            raise InputError(f"bench vocab size ({self.vocab_size}) must be at least 2.")


def parse_int_list(text: str, name: str) -> list[int]:
    """`"1,2,4"` -> `[1, 2, 4]` (duplicates dropped, order kept).

    Raises:
        InputError: an empty list, a value that is not an integer, or one below 1.
    """
    values: list[int] = []
    for piece in text.split(","):
        piece = piece.strip()
        try:
            value = int(piece)
        except ValueError:
            raise InputError(
                f"--{name} takes comma-separated positive integers, e.g. 1,2,4,8; "
                f"{piece!r} in {text!r} is not an integer."
            ) from None
        if value < 1:
            raise InputError(f"--{name} values must be positive, got {value} in {text!r}.")
        if value not in values:
            values.append(value)
    return values


def vocab_size_for(config: Config) -> int:
    """The vocabulary the benchmark's model gets (speed depends on it only through the LM head).

    A BPE config: `data.vocab_size`; a `tokenizer.json` path: that tokenizer's size; a character
    tokenizer: the distinct characters of `data.path` when it is one readable file, else 256.
    """
    tokenizer = config.data.tokenizer
    if tokenizer == "bpe":
        return config.data.vocab_size
    if tokenizer != "char":
        return int(load_tokenizer(tokenizer).vocab_size)
    path = Path(config.data.path) if config.data.path else None
    if path is not None and path.is_file():
        try:
            return max(2, len(set(path.read_text(encoding="utf-8")) | {"\n"}))
        except (OSError, UnicodeDecodeError):
            pass
    return 256


def combination_config(config: Config, n_head: int, context_length: int) -> ModelConfig:
    """The config's model with `n_head` and `context_length` replaced, validated.

    Raises:
        ConfigError: the combination breaks a model rule (the message names it).
    """
    model_cfg = dataclasses.replace(config.model, n_head=n_head, context_length=context_length)
    model_cfg.validate()
    return model_cfg


# ----------------------------------------------------------------------------- one combination


def _current_rss_mb() -> float | None:
    """Resident set size now (Linux /proc), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def measure(
    config: Config,
    n_head: int,
    context_length: int,
    device_name: str,
    settings: BenchSettings,
    track_cpu_memory: bool,
) -> BenchResult:
    """Measure one combination in this process (see the module docstring).

    Args:
        config: the validated config whose model, batch size, precision and optimizer are used.
        n_head, context_length: the combination.
        device_name: "auto", "cpu", "cuda" or "mps".
        settings: steps, tokens and repetitions.
        track_cpu_memory: report the process's peak RSS (only meaningful in a fresh process).

    Raises:
        ConfigError: the combination is invalid.
    """
    model_cfg = combination_config(config, n_head, context_length)
    device = resolve_device(device_name)
    precision = Precision.resolve(device, config.train.dtype)
    vocab = settings.vocab_size or vocab_size_for(config)
    rss_before = _current_rss_mb()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    gen = torch.Generator().manual_seed(settings.seed)
    model = Transformer(model_cfg, vocab, generator=gen).to(device)
    B, T = config.train.batch_size, context_length
    data = torch.randint(0, vocab, (B, T + 1), generator=gen).to(device)
    x, y = data[:, :-1], data[:, 1:]  # (B, T), (B, T)
    train_s = _time_training(model, x, y, config, precision, settings.train_steps)
    forward_s = _time_forward(model, x[:1], precision, settings.forward_reps)
    n_new = min(settings.sample_tokens, context_length - 1)
    sample_rate = None
    if n_new > 0:
        sample_rate = _sampling_rate(model, int(x[0, 0]), n_new, precision, settings.seed)

    result = BenchResult(
        n_head=n_head,
        context_length=context_length,
        head_size=model_cfg.n_embed // n_head,
        n_params=model.num_parameters(),
        train_tokens_per_s=B * T / train_s,
        sample_tokens_per_s=sample_rate,
        forward_ms=forward_s * 1e3,
    )
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        result.peak_memory_mb, result.memory_growth_mb = peak, peak
        result.memory_kind = "cuda_max_allocated"
    elif track_cpu_memory:
        result.peak_memory_mb = peak_rss_bytes() / 2**20
        if rss_before is not None:
            result.memory_growth_mb = result.peak_memory_mb - rss_before
        result.memory_kind = "cpu_peak_rss"
    return result


def _time_training(
    model: Transformer,
    x: torch.Tensor,
    y: torch.Tensor,
    config: Config,
    precision: Precision,
    steps: int,
) -> float:
    """Seconds per training step (`train_step` on `x`, `y`, one micro-batch), after one
    warm-up."""
    tc = config.train
    compiled = torch.compile(model) if tc.compile is True else None  # auto: for a run only
    trainer = make_trainer(model, tc, precision, SameBatch((x, y)), step_model=compiled)
    trainer.grad_accum = 1
    model.train()
    train_step(trainer)  # warms up (and compiles, with train.compile)
    return timed(lambda: [train_step(trainer) for _ in range(steps)], precision.device) / steps


def _time_forward(model: Transformer, x: torch.Tensor, precision: Precision, reps: int) -> float:
    """Median seconds of one inference forward pass over `x` `(1, T)`, after one warm-up."""
    model.eval()

    def forward() -> None:
        with precision.autocast():
            model(x)

    with torch.inference_mode():
        times = [timed(forward, precision.device) for _ in range(reps + 1)]
    return statistics.median(times[1:])  # the first one warms up


def _sampling_rate(
    model: Transformer, first: int, n_new: int, precision: Precision, seed: int
) -> float:
    """New tokens per second when sampling `n_new` tokens after the one token `first`, with the
    decode step `llmcli sample` would use."""
    config = SampleConfig(max_new_tokens=n_new, temperature=1.0, top_k=None, seed=seed)

    def sample() -> None:  # as `llmcli sample` runs it: without autocast (the fast step's)
        for _ in generate(model, [[first]], config):
            pass

    return n_new / timed(sample, precision.device)


def _measure_or_error(*args: Any) -> BenchResult:
    """`measure`, with a runtime failure (out of memory, say) turned into an "error" result."""
    n_head, context_length = args[1], args[2]
    try:
        return measure(*args)
    except (RuntimeError, MemoryError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return BenchResult(n_head, context_length, status="error", message=first_line)


# ----------------------------------------------------------------------------- all of them


def run_bench(
    config: Config,
    heads: Sequence[int] | None = None,
    seqs: Sequence[int] | None = None,
    device: str | None = None,
    settings: BenchSettings | None = None,
    *,
    isolate: bool = True,
    progress: bool = True,
) -> list[BenchResult]:
    """Measure every `(n_head, context_length)` combination, sequence length fastest.

    Args:
        config: a validated config.
        heads: head counts (default 1, 2, 4, 8).
        seqs: context lengths (default 64, 128, 256, 512).
        device: "auto", "cpu", "cuda" or "mps" (default: `train.device`).
        settings: work per combination (default `BenchSettings()`).
        isolate: run each valid combination in a fresh subprocess (needed for CPU peak RSS).
        progress: show a tqdm bar across the combinations.

    Returns:
        One `BenchResult` per combination, invalid ones included, in loop order.

    Raises:
        InputError: bad settings, an unusable device, or no valid combination at all.
    """
    settings = settings or BenchSettings()
    settings.validate()
    heads = list(heads or DEFAULT_HEADS)
    seqs = list(seqs or DEFAULT_SEQS)
    device = device or config.train.device
    resolve_device(device)  # an unusable device fails here, once, with its message
    if settings.vocab_size is None:
        settings = dataclasses.replace(settings, vocab_size=vocab_size_for(config))

    combos = [(h, t) for h in heads for t in seqs]
    results: list[BenchResult] = []
    invalid: list[str] = []
    bar = Progress(len(combos), desc="bench", unit="combo", enabled=progress)
    for n_head, context_length in combos:
        bar.report({"heads": str(n_head), "seq": str(context_length)})
        try:
            combination_config(config, n_head, context_length)
        except ConfigError as exc:
            results.append(BenchResult(n_head, context_length, status="invalid", message=str(exc)))
            invalid.append(f"heads={n_head}: {exc}")
            bar.update()
            continue
        args = (config, n_head, context_length, device, settings, isolate)
        if isolate:
            results.append(_in_fresh_process(args))
        else:
            results.append(_measure_or_error(*args))
        bar.update()
    bar.close()
    if not any(r.status != "invalid" for r in results):
        raise InputError(
            "no combination of --heads and --seq is valid for this model: "
            + "; ".join(dict.fromkeys(invalid))
        )
    return results


def _in_fresh_process(args: tuple) -> BenchResult:
    context = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            return pool.submit(_measure_or_error, *args).result()
    except BrokenProcessPool:
        return BenchResult(
            args[1],
            args[2],
            status="error",
            message="the measuring process died (killed for lack of memory?)",
        )
