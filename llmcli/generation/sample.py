"""`llmcli sample`'s library side: a run loaded for sampling, its samples, and their plain text.

`load_for_sampling` loads a run (`llmcli.runs.loading`) and applies the command line's settings
to its `sample:` config; `sample_run` samples from it with `llmcli.generation.batching`, on the
CPU threads `llmcli.generation.threads` picks, streaming to an
`llmcli.generation.streaming.OrderedWriter`, with the caller's hook functions at work (`llmcli
sample --steer` brings them: this package knows nothing of what they do); `format_samples` is
the plain text it prints once the samples are whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmcli.config import SampleConfig
from llmcli.device import resolve_device
from llmcli.generation.batching import Sample, SampleOptions, sample_texts
from llmcli.generation.streaming import OrderedWriter
from llmcli.generation.threads import sample_threads, torch_threads
from llmcli.model.hooks import HookFn
from llmcli.runs.loading import LoadedRun, load_run

logger = logging.getLogger(__name__)

#: Hook functions made for a loaded model: `model -> {hook point: [function, ...]}`, for
#: `model.hooks` while it generates (`llmcli sample --steer` makes SAE steering ones).
HookFactory = Callable[[Any], Mapping[str, HookFn | list[HookFn]]]


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
    threads = sample_threads(run.model, config, options.threads)
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
    kind: str = "text",
) -> tuple[LoadedRun, SampleConfig, SampleOptions]:
    """Load a run to sample from, as `sample_run` does: the run (with no `checkpoint`, the
    latest of `kind`: "text" to continue text, "chat" to chat), its `sample:` config with
    `overrides` applied (checked before the run loads, `context_keep` against its model), and
    `options` with the run's end-of-text id added to the stop ids."""
    overrides = dict(overrides or {})
    SampleConfig(**overrides)  # a mistyped setting fails at once, before the run loads
    device = resolve_device(options.device, what="--device")
    run = load_run(checkpoint, weights=options.weights, device=device, notify=notify, kind=kind)
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


def format_samples(samples: Sequence[Sample], separator: str = "-" * 15) -> str:
    """The plain-text output of `llmcli sample`: each prompt + completion, separator between."""
    out: list[str] = []
    writer = OrderedWriter(out.append, [s.prompt for s in samples], separator)
    for i, s in enumerate(samples):
        writer.text(i, s.completion)
        writer.end(i)
    return "".join(out)
