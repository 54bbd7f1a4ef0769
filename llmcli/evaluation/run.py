"""`llmcli eval`: a run's loss, perplexity and bits per byte on a whole text.

`evaluate_run` scores a run's model on its own validation split (the same split training reports,
rebuilt from the run's config and tokenizer) or on any UTF-8 text file. Unlike the training loop's
estimate (`llmcli.training.evaluate`), which averages `eval_steps` random batches, this is a
deterministic pass over consecutive windows in which every token after the first is predicted
exactly once (`llmcli.evaluation.text`). The command's settings travel whole as one
`EvalOptions`, checked as it is made: with `steps=N` only the first `N` batches of `batch_size`
windows are scored; `ablate` scores the model with heads removed (`llmcli.evaluation.heads`).
A caller's own hook functions (the command line's `--ablate-feature`, SAE features removed) come
in as `hooks`, made from the loaded model, and run after the heads'.
A `.jsonl` file is conversations instead, as a chat run's validation split is: scored on the
assistant's tokens (`llmcli.evaluation.chat`), with `answers` also the exact-match rate of
greedy replies. Preference pairs (a `.jsonl` file of TRL's rows, any `.jsonl` file but
conversations on a DPO run, or a DPO run's own validation pairs) are scored as DPO scores them,
against the run's reference (`llmcli.evaluation.preferences`).

Figures, over the predicted tokens:
- `loss`: mean cross-entropy in nats per token; `perplexity = exp(loss)`;
- `bits_per_byte`: total nats / ln 2 / total UTF-8 bytes of the predicted text. Unlike the
  loss, it does not depend on the tokenizer, so a char run and a BPE run compare. Special tokens
  (a BPE run's end-of-text separator) are no text: they are left out of both sums, as in
  nanochat's `evaluate_bpb`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from llmcli.config.shipped import shipped_data
from llmcli.device import check_threads, resolve_device, torch_threads
from llmcli.errors import InputError
from llmcli.evaluation.chat import (
    ChatEvalResult,
    evaluate_conversations,
    format_chat_result,
    is_conversations,
)
from llmcli.evaluation.heads import ablation_hooks, check_method, head_means, parse_ablate
from llmcli.evaluation.metrics import perplexity
from llmcli.evaluation.preferences import (
    PreferenceEvalResult,
    Reference,
    ReferenceLoader,
    evaluate_preferences,
    format_preference_result,
    is_preference_data,
    pair_reference,
)
from llmcli.evaluation.prompts import (
    PromptEvalResult,
    evaluate_prompts,
    format_prompt_result,
    is_prompt_data,
)
from llmcli.evaluation.text import (
    eval_tokens,
    per_token_records,
    score_tokens,
    text_bytes,
    window_batches,
    window_starts,
)
from llmcli.model.hooks import HookFn
from llmcli.objectives import objective_for
from llmcli.runs.loading import load_run

logger = logging.getLogger(__name__)

# Hook functions by hook point, as `model.hooks` takes them; or what makes them from the model
# (the run is loaded inside `evaluate_run`).
HookMap = Mapping[str, HookFn | list[HookFn]]
Hooks = HookMap | Callable[[nn.Module], HookMap]


@dataclass
class EvalResult:
    """What `evaluate_run` measured (JSON-ready through `to_dict`)."""

    run_dir: str
    weights: str
    step: int
    data: str
    tokens: int
    bytes: int
    windows: int
    loss: float
    perplexity: float
    bits_per_token: float
    bits_per_byte: float
    elapsed_s: float
    ablate: list[str] = field(default_factory=list)  # the `--ablate` specs: heads removed
    ablation: str | None = None  # how they were removed, with `ablate`
    ablate_feature: list[str] = field(default_factory=list)  # SAE features removed
    per_token: list[dict[str, Any]] | None = None  # with `--per-token`: `per_token_records`

    def to_dict(self) -> dict[str, Any]:
        """The summary (every field but `per_token`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "per_token"}


@dataclass(frozen=True)
class EvalOptions:
    """What `llmcli eval` scores, with which heads removed, and which weights it loads where.
    Checked as it is made, where a check needs no run (the heads in `ablate` are checked against
    the model by `ablation.parse_ablate`).

    Attributes:
        steps: score only the first `steps` batches (None: all of the text).
        batch_size: windows per batch (None: the run's `train.batch_size`).
        ablate: heads to remove, `"L.H"` or `"L"` each (see `ablation.parse_ablate`).
        ablation: "zero" (None means it too) or "mean": a removed head outputs zeros, or its
            mean output over the scored batches (computed in a first pass over them); only
            with `ablate`.
        weights: "best" or "last" weights of the run.
        device: "auto", "cpu", "cuda" or "mps".
        per_token: also keep each scored token's loss (`EvalResult.per_token`).
        threads: CPU threads (None: the run's `train.threads`).
        ablate_feature: the SAE features `evaluate_run`'s `hooks` remove, `SAE_DIR:FEATURE`
            each (`--ablate-feature`): named in the result, refused on conversations.
        answers: with conversations (`--data FILE.jsonl` on a chat run), also answer every
            assistant turn greedily and count the exact matches (`llmcli.evaluation.chat`).
        reference: with preference pairs, the run DPO's rewards are measured against (None: a
            DPO run's `train.init_from`; a run trained otherwise has none).

    Raises:
        InputError: `steps` or `batch_size` below 1, an unknown `ablation`, or one without
            `ablate`; `threads` outside 1..the CPUs this process may use.
    """

    steps: int | None = None
    batch_size: int | None = None
    ablate: Sequence[str] = ()
    ablation: str | None = None
    weights: str = "best"
    device: str = "auto"
    per_token: bool = False
    threads: int | None = None
    answers: bool = False
    ablate_feature: Sequence[str] = ()
    reference: str | Path | None = None

    def __post_init__(self) -> None:
        check_threads(self.threads)
        if self.steps is not None and self.steps < 1:
            raise InputError(f"--steps ({self.steps}) must be a positive number of batches.")
        if self.batch_size is not None and self.batch_size < 1:
            raise InputError(f"--batch-size ({self.batch_size}) must be positive.")
        if self.ablation is not None:
            check_method(self.ablation)
        if self.ablation is not None and not self.ablate:
            raise InputError(
                f"--ablation {self.ablation} says how --ablate removes heads: give --ablate L.H "
                "(or L) too."
            )

    @property
    def method(self) -> str | None:
        """How the heads in `ablate` are removed ("zero" unless `ablation` says "mean"); None
        when no head is."""
        return (self.ablation or "zero") if self.ablate else None


def evaluate_run(
    checkpoint: str | Path | None = None,
    data: str | Path | None = None,
    options: EvalOptions = EvalOptions(),
    *,
    hooks: Hooks | None = None,
    load_reference: ReferenceLoader | None = None,
    progress: bool = False,
    notify: Callable[[str], None] | None = None,
) -> EvalResult | ChatEvalResult | PreferenceEvalResult | PromptEvalResult:
    """Mean loss, perplexity and bits per byte of a run's model on a text; on conversations
    (a `.jsonl` `data`), the assistant tokens' loss (`llmcli.evaluation.chat`); on preference
    pairs, DPO's loss and rewards (`llmcli.evaluation.preferences`); on prompts with answers,
    greedy pass@1 (`llmcli.evaluation.prompts`).

    Args:
        checkpoint: a run directory (None: the latest run under `checkpoints/`).
        data: a UTF-8 text file to score (None: the run's validation split, see `eval_tokens`,
            or a DPO run's validation pairs), a `.jsonl` file of conversations, which needs a
            chat run, or one of preference pairs (`preferences.is_preference_data`).
        options: how many batches of what size, the heads to remove and how, which weights and
            the device (see `EvalOptions`, checked as it was made).
        hooks: more hook functions while the text is scored, run after the removed heads':
            `{hook point: function or list}`, or a function of the loaded model that returns
            them (the command line's `--ablate-feature`: `options.ablate_feature` names what
            they remove). Text only: refused on conversations, as `--ablate-feature` is.
        load_reference: builds a DPO run's reference from its config, as training does
            (`llmcli.training.init_from.reference_model`, which the command line passes: evaluation
            sits below training); needed for a DPO run's pairs without `options.reference`.
        progress: show progress (a bar on a terminal, plain lines elsewhere): of the scoring
            pass, and of the first pass that mean ablation needs.
        notify: called with one line per warning (installed versions differ from the run's).

    Raises:
        InputError: a bad run directory or data file, a head of `options.ablate` the model does
            not have (see `eval_tokens`, `ablation.parse_ablate`); conversations on a run with
            no chat template; `options.answers` without conversations; `options.reference`
            without pairs, or with another tokenizer than the run's.
        ValueError: `options.ablate_feature` without the `hooks` that remove them; a DPO run's
            pairs without `load_reference` or `options.reference`.
    """
    if options.ablate_feature and hooks is None:
        raise ValueError("options.ablate_feature names what `hooks` remove: pass the hooks too.")
    t0 = time.perf_counter()
    data = None if data is None else shipped_data(data)  # the docs' `data/...` from anywhere
    dev = resolve_device(options.device, what="--device")
    run = load_run(checkpoint, weights=options.weights, device=dev, notify=notify)
    with torch_threads(options.threads or run.config.train.threads):
        own = objective_for(run.config).eval_data  # what the run's own data are
        if is_prompt_data(data, own == "prompts"):
            _refuse_text_options(options, hooks, "prompts", answers=True)
            batch_size = options.batch_size or run.config.train.batch_size
            return evaluate_prompts(
                run, None if data is None else Path(data), batch_size, progress=progress, t0=t0
            )
        if is_preference_data(data, own == "pairs"):
            _refuse_text_options(options, hooks, "preference pairs", answers=True)
            reference = pair_reference(run, options.reference, load_reference, dev, notify)
            return _evaluate_pairs(run, data, reference, options, t0, progress=progress)
        if options.reference is not None:
            raise InputError(
                "--reference is what DPO's rewards on preference pairs are measured against: "
                'give pairs as --data FILE.jsonl (rows of {"prompt", "chosen", "rejected"}), or '
                "drop it."
            )
        if is_conversations(data) or (data is None and own == "conversations"):
            _refuse_text_options(options, hooks, "conversations")
            return _evaluate_chat(run, data, options, t0, progress=progress)
        if options.answers:
            raise InputError(
                "--answers compares greedy replies with the assistant's turns of conversations: "
                'give --data FILE.jsonl (rows of {"messages": [...]}) on a chat run.'
            )
        return _evaluate(run, data, options, t0, hooks=hooks, progress=progress)


def _refuse_text_options(
    options: EvalOptions, hooks: Hooks | None, what: str, *, answers: bool = False
) -> None:
    """Refuse, on `what` (conversations, preference pairs), what applies to text windows only
    (and with `answers`, `--answers`, which answers conversations)."""
    refused = {"--ablate": options.ablate, "--per-token": options.per_token}
    refused["--ablate-feature"] = bool(options.ablate_feature) or hooks is not None
    option = next((name for name, given in refused.items() if given), None)
    if option is not None:
        raise InputError(
            f"{option} scores text windows, not {what}: drop it, or give a text file as --data."
        )
    if answers and options.answers:
        raise InputError(
            f"--answers replies to the assistant's turns of conversations, not {what}: drop it."
        )


def _evaluate_chat(
    run: Any, data: str | Path | None, options: EvalOptions, t0: float, *, progress: bool
) -> ChatEvalResult:
    """`evaluate_run` on conversations (`llmcli.evaluation.chat`)."""
    return evaluate_conversations(
        run,
        None if data is None else Path(data),
        options.batch_size or run.config.train.batch_size,
        steps=options.steps,
        answers=options.answers,
        progress=progress,
        t0=t0,
    )


def _evaluate_pairs(
    run: Any,
    data: str | Path | None,
    reference: Reference | None,
    options: EvalOptions,
    t0: float,
    *,
    progress: bool,
) -> PreferenceEvalResult:
    """`evaluate_run` on preference pairs (`llmcli.evaluation.preferences`)."""
    return evaluate_preferences(
        run,
        None if data is None else Path(data),
        reference,
        options.batch_size or run.config.train.batch_size,
        steps=options.steps,
        progress=progress,
        t0=t0,
    )


def _evaluate(
    run: Any,
    data: str | Path | None,
    options: EvalOptions,
    t0: float,
    *,
    hooks: Hooks | None,
    progress: bool,
) -> EvalResult:
    """`evaluate_run` on a loaded run; `t0` is when the command began."""
    dev = next(run.model.parameters()).device
    ablate, steps = options.ablate, options.steps
    head_mask = None
    if ablate:
        head_mask = parse_ablate(ablate, run.model.n_layer, run.model.n_head).to(dev)
    tokens, label = eval_tokens(run, data)
    ctx = run.config.model.context_length
    batch_size = options.batch_size or run.config.train.batch_size
    head_mean = None
    if options.method == "mean":
        starts = window_starts(len(tokens), ctx, batch_size, steps)
        batches = window_batches(tokens, ctx, starts, dev)
        head_mean = head_means(run.model, batches, progress=progress, total=len(starts))
    heads = {} if head_mask is None else ablation_hooks(head_mask, head_mean)
    extra = hooks(run.model) if callable(hooks) else hooks or {}
    with run.model.hooks(heads), run.model.hooks(extra):  # heads first, then the caller's
        totals = score_tokens(
            run.model,
            tokens,
            ctx,
            batch_size,
            steps=steps,
            special_id=getattr(run.tokenizer, "eot_id", None),
            progress=progress,
            per_token=options.per_token,
        )
    scored = np.asarray(tokens[1 : 1 + totals.tokens], dtype=np.int64)  # the predicted tokens
    n_bytes = text_bytes(run.tokenizer, scored)
    loss = totals.nats / totals.tokens
    return EvalResult(
        run_dir=str(run.run_dir),
        weights=str(run.weights_path),
        step=run.step,
        data=label,
        tokens=totals.tokens,
        bytes=n_bytes,
        windows=totals.windows,
        loss=loss,
        perplexity=perplexity(loss),
        bits_per_token=loss / math.log(2),
        bits_per_byte=totals.text_nats / math.log(2) / n_bytes if n_bytes else math.nan,
        elapsed_s=time.perf_counter() - t0,
        ablate=list(ablate),
        ablation=options.method,
        ablate_feature=list(options.ablate_feature),
        per_token=None
        if totals.losses is None
        else per_token_records(run.tokenizer, tokens, totals.losses),
    )


def format_result(
    result: EvalResult | ChatEvalResult | PreferenceEvalResult | PromptEvalResult,
) -> str:
    """A few human-readable lines."""
    if isinstance(result, PromptEvalResult):
        return format_prompt_result(result)
    if isinstance(result, ChatEvalResult):
        return format_chat_result(result)
    if isinstance(result, PreferenceEvalResult):
        return format_preference_result(result)
    text = (
        f"run {result.run_dir} (step {result.step}, {Path(result.weights).name})\n"
        f"data: {result.data}: {result.tokens:,} tokens predicted, {result.bytes:,} bytes, "
        f"{result.windows:,} windows\n"
        f"loss {result.loss:.4f} nats/token, perplexity {result.perplexity:.3f}, "
        f"{result.bits_per_token:.4f} bits/token, {result.bits_per_byte:.4f} bits/byte"
    )
    if result.ablate:
        text += f"\nheads removed ({result.ablation} ablation): {', '.join(result.ablate)}"
    if result.ablate_feature:
        text += f"\nSAE features removed: {', '.join(result.ablate_feature)}"
    return text
