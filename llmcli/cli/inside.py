"""`llmcli inspect-attention` and `eval`: looking inside a trained run, and scoring it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from llmcli.cli.app import app, log_to_stderr, notify, result_text
from llmcli.cli.options import (
    AblationCommand,
    CheckpointOption,
    DataOption,
    DeviceOption,
    JsonOption,
    ProgressOption,
    RunThreadsOption,
    WeightsOption,
)

if TYPE_CHECKING:
    from torch import nn

    from llmcli.evaluation.run import HookMap

# inspect-attention's prompts, and the layers and heads it keeps.
PromptsOption = Annotated[
    Optional[list[str]],
    typer.Option(
        help="Prompt text; repeatable, one dump per prompt (default: the start of the "
        "run's validation text).",
        metavar="TEXT",
    ),
]
PromptFileOption = Annotated[
    Optional[Path],
    typer.Option(help="More prompts: one per line, or a JSON list of strings.", metavar="FILE"),
]
LayerOption = Annotated[
    Optional[list[int]],
    typer.Option(help="Keep only this layer (0-based); repeatable (default: all).", metavar="L"),
]
HeadOption = Annotated[
    Optional[list[int]],
    typer.Option(help="Keep only this head (0-based); repeatable (default: all).", metavar="H"),
]


@app.command("inspect-attention", cls=AblationCommand)
def inspect_attention_command(
    checkpoint: CheckpointOption = None,
    prompt: PromptsOption = None,
    prompt_file: PromptFileOption = None,
    layer: LayerOption = None,
    head: HeadOption = None,
    out: Annotated[
        Optional[Path],
        typer.Option(
            help="Output folder (default: <run>/attention/); several prompts go to "
            "prompt-000/, prompt-001/, ... inside it.",
            metavar="DIR",
        ),
    ] = None,
    format_: Annotated[
        str, typer.Option("--format", help="Dump format: npz, safetensors or json.", metavar="FMT")
    ] = "npz",
    induction: Annotated[
        bool,
        typer.Option(help="Add induction scores: on the prompt's repeats, on a fixed probe."),
    ] = False,
    truncate: Annotated[
        bool,
        typer.Option(help="Keep the last context_length tokens of a longer prompt."),
    ] = False,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
    pictures: Annotated[
        bool, typer.Option("--pictures/--no-pictures", help="Write one PNG per layer.")
    ] = True,
    ablation: Annotated[
        Optional[str],
        typer.Option(
            help="Add each head's loss increase when it is removed, measured on --data: zero, "
            "mean or both (a metric column, ablation.png, the top heads).",
            metavar="METHOD",
        ),
    ] = None,
    ablation_steps: Annotated[
        Optional[int],
        typer.Option(help="Batches --ablation measures on (default: 20).", metavar="N"),
    ] = None,
    data: DataOption = None,
    threads: RunThreadsOption = None,
    progress: ProgressOption = True,
) -> None:
    """Dump every head's attention for a prompt, score each head, draw it, write a viewer."""
    from llmcli.inspection.attention import InspectOptions, format_report, inspect_attention

    log_to_stderr()

    options = InspectOptions(
        layers=tuple(layer or ()),
        heads=tuple(head or ()),
        fmt=format_,
        induction=induction,
        truncate=truncate,
        pictures=pictures,
        ablation=ablation,
        ablation_steps=ablation_steps,
        ablation_data=data,
        weights=weights,
        device=device,
        threads=threads,
    )
    result = inspect_attention(
        checkpoint,
        prompt or [],
        options,
        prompt_file=prompt_file,
        out_dir=out,
        notify=notify,
        progress=progress,
    )
    typer.echo(format_report(result), nl=False)


# eval's --data also takes conversations (on a chat run), which --answers answers, and
# preference pairs, which --reference scores against.
EvalDataOption = Annotated[
    Optional[Path],
    typer.Option(
        help="A UTF-8 text file to measure on, in windows of context_length tokens (default: "
        "the run's validation split). On a chat run, a .jsonl file of conversations (rows of "
        '{"messages": [{"role", "content"}, ...]}), as its validation split, is scored on the '
        "assistant's tokens only, a conversation too long for the context cut after its last "
        "assistant turn that fits. A .jsonl file of preference pairs (TRL's rows of "
        '{"prompt", "chosen", "rejected"}, '
        "text or messages), as a DPO run's validation split, gets DPO's loss, reward accuracy "
        "and margins against the reference (--reference), and the share of pairs whose chosen "
        "reply the run scores higher.",
        metavar="PATH",
    ),
]
ReferenceOption = Annotated[
    Optional[Path],
    typer.Option(
        help="With preference pairs: the run DPO's rewards are measured against, with the "
        "run's tokenizer (default: a DPO run's train.init_from; a run trained otherwise has "
        "none, and reports its own log-probabilities only).",
        metavar="RUN",
    ),
]
AnswersOption = Annotated[
    bool,
    typer.Option(
        "--answers",
        help="With conversations (--data FILE.jsonl): also reply greedily to each assistant "
        "turn and count the replies exactly equal to it (--json lists each expected and got).",
    ),
]

# eval's batches: of text windows, conversations or preference pairs.
EvalStepsOption = Annotated[
    Optional[int],
    typer.Option(
        help="Score only the first N batches (default: all of the data; --steps 20 takes "
        "seconds on the tiny run).",
        metavar="N",
    ),
]
EvalBatchSizeOption = Annotated[
    Optional[int],
    typer.Option(
        help="Windows of context_length tokens per batch, or conversations, or preference "
        "pairs (default: the run's train.batch_size)."
    ),
]
PerTokenOption = Annotated[
    bool,
    typer.Option(
        "--per-token",
        help="Print each scored token's loss as JSON lines, one object per window: "
        '{"window": k, "start": s, "ids": [...], "tokens": [...], "losses": [...]}, '
        "tokens[i] being token s+1+i of the text and losses[i] its loss in nats; the "
        "summary goes to stderr (as JSON with --json).",
    ),
]

# eval's --ablate-feature: SAE features removed at their hook points (`feature_ablation`).
AblateFeatureOption = Annotated[
    Optional[list[str]],
    typer.Option(
        help="Remove an SAE feature: its activation times its decoder direction is taken out at "
        "the SAE's hook point (the SAE's reconstruction error stays); repeatable.",
        metavar="SAE_DIR:FEATURE",
    ),
]


@app.command("eval", cls=AblationCommand)
def eval_command(
    checkpoint: CheckpointOption = None,
    data: EvalDataOption = None,
    steps: EvalStepsOption = None,
    batch_size: EvalBatchSizeOption = None,
    ablate: Annotated[
        Optional[list[str]],
        typer.Option(
            help="Remove a head: L.H (head H of layer L) or L (every head of layer L), 0-based; "
            "repeatable.",
            metavar="SPEC",
        ),
    ] = None,
    ablation: Annotated[
        Optional[str],
        typer.Option(
            help="How --ablate removes a head: zero (its output zeroed; the default) or mean "
            "(replaced by its mean output over the scored text).",
            metavar="METHOD",
        ),
    ] = None,
    ablate_feature: AblateFeatureOption = None,
    weights: WeightsOption = "best",
    device: DeviceOption = "auto",
    json_: JsonOption = False,
    per_token: PerTokenOption = False,
    answers: AnswersOption = False,
    reference: ReferenceOption = None,
    threads: RunThreadsOption = None,
    progress: ProgressOption = True,
) -> None:
    """Mean loss, perplexity and bits per byte of a run on its validation split or a text; on
    conversations, the assistant's loss; on preference pairs, DPO's loss and rewards."""
    import json

    from llmcli.evaluation.run import EvalOptions, evaluate_run, format_result
    from llmcli.training.init_from import reference_model

    log_to_stderr()
    options = EvalOptions(
        steps=steps,
        batch_size=batch_size,
        ablate=tuple(ablate or ()),
        ablation=ablation,
        weights=weights,
        device=device,
        per_token=per_token,
        threads=threads,
        answers=answers,
        ablate_feature=tuple(ablate_feature or ()),
        reference=reference,
    )
    hooks = feature_ablation(options.ablate_feature)
    # A DPO run's reference is built as training builds it: evaluation sits below training.
    evaluate = partial(evaluate_run, load_reference=reference_model, notify=notify)
    result = evaluate(checkpoint, data, options, hooks=hooks, progress=progress)
    summary = result_text(result, json_, format_result)
    if result.per_token is None:
        typer.echo(summary)
        return
    # stdout carries only the JSON lines, so that `| jq` reads them whole.
    for record in result.per_token:
        typer.echo(json.dumps(record, ensure_ascii=False))
    notify(summary)


def feature_ablation(specs: Sequence[str]) -> Callable[[nn.Module], HookMap] | None:
    """`--ablate-feature SAE_DIR:FEATURE` options as `evaluate_run`'s hooks: made from the model
    it loads (`llmcli.inspection.sae.steer.ablation_hooks`), after the heads' (None: none given).
    Evaluation knows no SAEs; the command line composes them, as it does the heads."""
    if not specs:
        return None
    from llmcli.inspection.sae.steer import ablation_hooks

    return partial(ablation_hooks, specs=specs)
