"""`llmcli sample`: text from a trained run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from llmcli.cli.app import ThrottledStdout, app, notify
from llmcli.cli.options import CheckpointOption, DeviceOption, WeightsOption
from llmcli.errors import InputError

if TYPE_CHECKING:
    from llmcli.generation.sample import SampleOptions

# `llmcli sample`'s prompts and generation options.
PromptOption = Annotated[
    Optional[str],
    typer.Option(
        help="Prompt text; '-' reads it from stdin (default: empty prompt).", metavar="TEXT"
    ),
]
PromptFileOption = Annotated[
    Optional[Path],
    typer.Option(
        help="File of prompts, one per line or a JSON list; all run as one batch.", metavar="FILE"
    ),
]
# The sample: settings (each defaults to the run's config).
MaxNewTokensOption = Annotated[
    Optional[int], typer.Option(help="Tokens to generate per sample (default: run config).")
]
TemperatureOption = Annotated[
    Optional[float], typer.Option(help="Sampling temperature, >= 0; 0 is greedy.")
]
TopKOption = Annotated[
    Optional[int],
    typer.Option(help="Keep the k most likely tokens (>= 1; >= vocab size keeps all)."),
]
TopPOption = Annotated[
    Optional[float], typer.Option(help="Nucleus sampling mass in (0, 1]; 1 keeps all.")
]
SeedOption = Annotated[Optional[int], typer.Option(help="Random seed; sample r uses seed + r.")]
ContextPolicyOption = Annotated[
    Optional[str],
    typer.Option(
        help="Past the context: exact (the last context_length tokens, recomputed each step) "
        "or shift (keep the last tokens, go on with the KV cache) (default: run config).",
        metavar="POLICY",
    ),
]
ContextKeepOption = Annotated[
    Optional[int],
    typer.Option(
        help="Tokens shift keeps when the context is full, 1..context_length-1 (default: run "
        "config, else context_length // 2).",
        metavar="N",
    ),
]
ThreadsOption = Annotated[
    Optional[int],
    typer.Option(
        help="CPU threads (default: 1 for a small model decoding one token per step, else "
        "torch's own).",
        metavar="N",
    ),
]

NumSamplesOption = Annotated[int, typer.Option(help="Samples per prompt, run as one batch.")]
StopOption = Annotated[
    Optional[list[str]],
    typer.Option(
        help="End a sample when this text appears (not printed; \\n, \\t work); repeatable.",
        metavar="TEXT",
    ),
]
StreamOption = Annotated[
    Optional[bool],
    typer.Option("--stream/--no-stream", help="Print tokens as they come (default: on a TTY)."),
]
JsonOption = Annotated[
    bool,
    typer.Option("--json", help="One JSON object per sample (prompt, completion, tokens...)."),
]
IgnoreEosOption = Annotated[
    Optional[bool],
    typer.Option(
        "--ignore-eos/--stop-at-eos",
        help="Go on past the end-of-text token (shown as <|endoftext|>) to --max-new-tokens; "
        "by default a sample ends there (default: run config's sample.ignore_eos).",
    ),
]
InteractiveOption = Annotated[
    bool,
    typer.Option(
        "--interactive",
        "-i",
        help="Keep the model loaded and answer prompts read line by line from stdin (a "
        "terminal or a pipe), streamed; /temperature 0.5, /top_k 50, /seed 1... change the "
        "settings, /help lists them; Ctrl-C stops an answer, Ctrl-D exits.",
    ),
]


@app.command("sample")
def sample_command(
    checkpoint: CheckpointOption = None,
    prompt: PromptOption = None,
    prompt_file: PromptFileOption = None,
    max_new_tokens: MaxNewTokensOption = None,
    temperature: TemperatureOption = None,
    top_k: TopKOption = None,
    top_p: TopPOption = None,
    seed: SeedOption = None,
    num_samples: NumSamplesOption = 1,
    stop: StopOption = None,
    stream: StreamOption = None,
    json_: JsonOption = False,
    context_policy: ContextPolicyOption = None,
    context_keep: ContextKeepOption = None,
    threads: ThreadsOption = None,
    ignore_eos: IgnoreEosOption = None,
    interactive: InteractiveOption = False,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
) -> None:
    """Generate text from a trained run (KV-cached, batched), or talk to it (--interactive)."""
    import json

    from llmcli.generation.sample import (
        SampleOptions,
        format_samples,
        read_prompts,
        sample_run,
        unescape,
    )

    write = ThrottledStdout()
    options = SampleOptions(
        num_samples=num_samples,
        stop=tuple(unescape(text) for text in stop or []),
        threads=threads,
        weights=weights,
        device=device,
    )
    # The run's sample: config, changed by the options given (None: not given).
    settings = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        context_policy=context_policy,
        context_keep=context_keep,
        ignore_eos=ignore_eos,
    )
    overrides = {key: value for key, value in settings.items() if value is not None}
    if interactive:
        if prompt_file is not None or json_:
            raise InputError(
                "--interactive reads its prompts from stdin: leave out --prompt-file and --json."
            )
        _interactive(checkpoint, prompt, overrides, options, write)
        return
    streaming = (sys.stdout.isatty() if stream is None else stream) and not json_
    prompts = read_prompts(prompt, prompt_file)
    samples = sample_run(
        checkpoint,
        prompts,
        overrides,
        options,
        write=write if streaming else None,
        notify=notify,
    )
    if json_:
        for sample in samples:
            typer.echo(json.dumps(sample.to_dict(), ensure_ascii=False))
    elif not streaming:
        write(format_samples(samples))
    sys.stdout.flush()


def _interactive(
    checkpoint: Optional[Path],
    prompt: Optional[str],
    overrides: dict,
    options: SampleOptions,
    write: ThrottledStdout,
) -> None:
    """`sample --interactive`: load the run once, then answer stdin's lines (a first --prompt)."""
    from llmcli.generation.interactive import interactive
    from llmcli.generation.sample import load_for_sampling

    run, config, options = load_for_sampling(checkpoint, overrides, options, notify)
    tty = sys.stdin.isatty()
    if tty:
        import readline  # noqa: F401  (line editing and history for input())

        notify(f"{run.run_dir}: type a prompt; /help lists the commands, Ctrl-D exits")
    pending = [prompt] if prompt is not None else []

    def read_line() -> str | None:
        sys.stdout.flush()
        if pending:
            return pending.pop()
        if tty:
            try:
                return input("> ")
            except EOFError:
                return None
        line = sys.stdin.readline()
        return line.rstrip("\r\n") if line else None

    interactive(run, config, options, read_line, write, notify)
    sys.stdout.flush()
