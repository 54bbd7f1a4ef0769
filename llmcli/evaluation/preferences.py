"""`llmcli eval` on preference pairs: how a run ranks the chosen and rejected replies of each
pair, measured as DPO measures it (`llmcli.objectives.preference_scores`).

The pairs are a JSONL file of TRL's rows (`llmcli.data.preferences`: `{"prompt", "chosen",
"rejected"}`, text or messages), or, with no file, a DPO run's own validation pairs as training
split them (`llmcli.data.preference_data`). They are encoded with the run's tokenizer and chat
template as DPO encodes them, and fitted to the context as training fits them: a pair too long
has both completions cut to the room its prompt leaves, or is skipped (both counted). Every pair
is then scored once, in order, `batch_size` pairs a batch: each reply's summed completion
log-probability under the run's model and, where there is one, under the reference.

The reference is what DPO's rewards are measured against: a DPO run's `train.init_from`, loaded
as training loads it, or any run with the same tokenizer (`--reference`). Against it come
DPO's loss (the run's `train.loss_type`, `loss_weights`, `label_smoothing` and `dpo_beta`;
`llmcli.objectives.dpo_losses`) and TRL's metrics: `rewards/accuracies`, `rewards/margins`,
`rewards/chosen`, `rewards/rejected`. Each is computed over all the pairs at once, as TRL's
`DPOTrainer.evaluate` computes them over one batch holding every pair. Without a reference (a
run not trained with DPO, and no `--reference`), only the run's own figures: `logps/chosen` and
`logps/rejected` (mean summed log-probabilities), `logits/chosen` and `logits/rejected` (TRL's:
the mean logit at the completion tokens), and `logps/accuracies`, the share of pairs whose
chosen reply the model scores strictly higher, a before/after figure of a DPO run and the run
it started from.

Shapes: `P` pairs scored, `B` pairs a batch, `L` tokens a row.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmcli.config import Config
from llmcli.data.chat_template import load_run_template
from llmcli.data.preference_data import (
    PreferenceSplit,
    encode_split,
    prepare_preference_data,
)
from llmcli.data.preferences import KEYS, SHAPE, PreferenceEncoder, read_preferences
from llmcli.data.tokenizer import Tokenizer
from llmcli.errors import InputError
from llmcli.evaluation.chat import is_conversations
from llmcli.fileio import refuse_special_file
from llmcli.objectives import objective_for
from llmcli.objectives.dpo_losses import DPOLoss, dpo_loss, mean_logit
from llmcli.objectives.preference_scores import PairLogps, score_pairs
from llmcli.progress import counted
from llmcli.runs.directory import CONFIG_FILE
from llmcli.runs.loading import LoadedRun, load_run, load_tokenizer_file

# Builds a DPO run's frozen reference from its config, vocabulary size and device: training's
# own (`llmcli.training.init_from.reference_model`), which the command line passes in, since
# evaluation sits below training.
ReferenceLoader = Callable[[Config, int, torch.device], nn.Module]

# The figures, in the order `--json` and the text give them (TRL's names, and the model's own
# ranking of the replies).
FIGURES = (
    "rewards/accuracies",
    "rewards/margins",
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "logps/accuracies",
)


def is_preference_data(data: str | Path | None, dpo: bool) -> bool:
    """Whether `llmcli eval`'s data are preference pairs: with no file, a DPO run's (`dpo`)
    validation pairs; a `.jsonl` file whose first row has one of TRL's keys ("prompt", "chosen",
    "rejected"), or, on a DPO run, any `.jsonl` file but one of conversations ("messages")."""
    if data is None:
        return dpo
    if not is_conversations(data):
        return False
    keys = first_row_keys(Path(data))
    # (A file with no readable first row goes to the conversations' reader, which says why.)
    return bool(keys & set(KEYS)) or (dpo and bool(keys) and "messages" not in keys)


def first_row_keys(path: Path) -> set[str]:
    """The keys of a file's first non-blank row; none for a file that is not a regular one, is
    unreadable, or does not start with a JSON object (its reader then says what is wrong)."""
    if not path.is_file():
        return set()
    try:
        with path.open("rb") as fh:
            line = next((raw for raw in fh if raw.strip()), b"")
        row = json.loads(line)
    except (OSError, ValueError, RecursionError):  # unreadable, not UTF-8, not JSON
        return set()
    return set(row) if isinstance(row, dict) else set()


# --- The reference ---------------------------------------------------------------------------


@dataclass
class Reference:
    """The model DPO's rewards are measured against, how the result names it, and DPO's loss
    (its beta and loss types)."""

    model: nn.Module
    name: str
    loss: DPOLoss


def pair_reference(
    run: LoadedRun,
    reference: str | Path | None,
    load_dpo_reference: ReferenceLoader | None,
    device: torch.device,
    notify: Callable[[str], None] | None = None,
) -> Reference | None:
    """The reference of `run`'s pairs: the run `reference` names, else a DPO run's
    `train.init_from` (built by `load_dpo_reference`, as training builds it), else None.

    Raises:
        InputError: a reference that is gone, unreadable, or has another tokenizer than the run.
        ValueError: a DPO run's own reference wanted without `load_dpo_reference`.
    """
    loss = DPOLoss.from_config(run.config.train)
    if reference is not None:
        other = load_run(reference, device=device, notify=notify)
        check_same_tokenizer(run, other.tokenizer, f"--reference '{other.run_dir}'")
        return Reference(other.model, str(other.run_dir), loss)
    init_from = run.config.train.init_from
    if objective_for(run.config).eval_data != "pairs" or init_from is None:  # not DPO's
        return None
    if load_dpo_reference is None:
        raise ValueError(
            "a DPO run's pairs are scored against its train.init_from: pass load_dpo_reference "
            "(llmcli.training.init_from.reference_model), or a reference run."
        )
    base = Path(init_from).expanduser()
    if base.is_absolute() and not base.exists():  # training wrote a base run's absolute path
        raise InputError(
            f"the run's reference, its train.init_from '{base}', no longer exists: DPO's "
            "rewards are measured against it. Put the run it was fine-tuned from back there, or "
            "pass it as --reference RUN."
        )
    if (base / CONFIG_FILE).is_file():  # an llmcli run: its tokenizer is the DPO run's
        check_same_tokenizer(run, load_tokenizer_file(base), f"train.init_from '{base}'")
    vocab_size = int(run.tokenizer.vocab_size)
    return Reference(load_dpo_reference(run.config, vocab_size, device), init_from, loss)


def check_same_tokenizer(run: LoadedRun, tokenizer: Tokenizer, name: str) -> None:
    """Refuse a reference whose tokenizer is not the run's: its log-probabilities would be of
    other tokens, and their differences meaningless.

    Raises:
        InputError: naming the reference, the run and their vocabulary sizes.
    """
    if tokenizer.to_json() != run.tokenizer.to_json():
        raise InputError(
            f"the reference {name} has another tokenizer than the run '{run.run_dir}' "
            f"({tokenizer.vocab_size:,} and {run.tokenizer.vocab_size:,} tokens): DPO compares "
            "the two models' log-probabilities of the same tokens. Give the run this one was "
            "fine-tuned from, or another with its tokenizer."
        )


# --- Reading: pairs that fit the context -------------------------------------------------------


def read_pairs(path: Path, encoder: PreferenceEncoder, context_length: int) -> PreferenceSplit:
    """The pairs of a JSONL file, encoded and fitted to the context as training fits them.

    Raises:
        InputError: a malformed row or one the encoder refuses (file and line named), a file
            that is not a regular one, a file with no pair, or one whose every pair is skipped.
    """
    refuse_special_file(path, f"--data {str(path)!r}", "a JSONL file")
    split = encode_split(read_preferences(path), encoder, context_length)
    if split.counts["pairs"] == 0:
        raise InputError(f"--data {str(path)!r} holds no preference pairs: one row of {SHAPE}.")
    if len(split) == 0:
        raise InputError(
            f"every pair of {str(path)!r} is too long for the model's context ({context_length} "
            "tokens): its prompt leaves no room for a completion token, or the cut completions "
            "are the same. Shorten the prompts."
        )
    return split


def split_pairs(run: LoadedRun, encoder: PreferenceEncoder) -> tuple[PreferenceSplit, str]:
    """A DPO run's validation pairs as training split and fitted them, and a label: rebuilt from
    the run's config (its pair files must still be readable).

    Raises:
        InputError: the split cannot be rebuilt (the message says how to go on).
    """
    data, ctx = run.config.data, run.config.model.context_length
    template = None if encoder.conversations is None else encoder.conversations.template
    try:
        pairs = prepare_preference_data(data, ctx, run.tokenizer, template)
    except InputError as exc:
        raise InputError(
            f"cannot rebuild the validation pairs of '{run.run_dir}': {exc} Or pass --data "
            "FILE.jsonl to score the pairs of a file."
        ) from None
    return pairs.val, f"validation pairs of {data.val_path or data.path}"


# --- Scoring ---------------------------------------------------------------------------------


def pair_figures(logps: PairLogps, loss: DPOLoss | None) -> tuple[float | None, dict[str, Any]]:
    """DPO's loss over all the pairs at once (None without a reference) and `FIGURES` (the
    rewards None without a reference)."""
    chosen, rejected = logps.chosen, logps.rejected
    figures: dict[str, Any] = dict.fromkeys(FIGURES)
    value = None
    if logps.ref_chosen is not None and logps.ref_rejected is not None and loss is not None:
        total, metrics = dpo_loss(chosen, rejected, logps.ref_chosen, logps.ref_rejected, loss)
        value = total.item()
        figures.update({name: metric.item() for name, metric in metrics.items()})
    figures["logps/chosen"] = chosen.logps.mean().item()
    figures["logps/rejected"] = rejected.logps.mean().item()
    figures["logits/chosen"] = mean_logit(chosen).item()
    figures["logits/rejected"] = mean_logit(rejected).item()
    figures["logps/accuracies"] = (chosen.logps > rejected.logps).float().mean().item()
    return value, figures


# --- The whole evaluation --------------------------------------------------------------------


@dataclass
class PreferenceEvalResult:
    """What `evaluate_preferences` measured (JSON-ready through `to_dict`)."""

    run_dir: str
    weights: str
    step: int
    data: str
    reference: str | None  # what the rewards are measured against (None: nothing)
    beta: float | None
    loss_type: list[str] | None  # the loss types summed (None without a reference)
    loss_weights: list[float] | None  # their weights (None: 1.0 each)
    pairs: int  # scored (truncated ones included)
    truncated: int  # of those, with their completions cut to fit the context
    skipped: int  # too long for the context
    skipped_at: list[str]  # where they are
    loss: float | None  # DPO's, mean over the pairs (None without a reference)
    figures: dict[str, Any]  # `FIGURES` by name
    elapsed_s: float
    per_pair: list[dict[str, Any]] = field(default_factory=list)
    per_token: None = None  # eval's --per-token is for text windows only

    def to_dict(self) -> dict[str, Any]:
        """Every figure under its own name (TRL's), and each pair's scores."""
        summary = {
            "run_dir": self.run_dir,
            "weights": self.weights,
            "step": self.step,
            "data": self.data,
            "reference": self.reference,
            "beta": self.beta,
            "loss_type": self.loss_type,
            "loss_weights": self.loss_weights,
            "pairs": self.pairs,
            "truncated": self.truncated,
            "skipped": self.skipped,
            "skipped_at": self.skipped_at,
            "loss": self.loss,
        }
        return {**summary, **self.figures, "elapsed_s": self.elapsed_s, "per_pair": self.per_pair}


def evaluate_preferences(
    run: LoadedRun,
    data: Path | None,
    reference: Reference | None,
    batch_size: int,
    *,
    steps: int | None = None,
    progress: bool = False,
    t0: float | None = None,
) -> PreferenceEvalResult:
    """`llmcli eval` on a loaded run's preference pairs (see the module doc).

    Args:
        run: the loaded run (a conversational pair needs its chat template).
        data: a JSONL file of pairs (None: a DPO run's validation pairs).
        reference: what the rewards are measured against (`pair_reference`; None: nothing).
        batch_size: pairs scored together.
        steps: score only the first `steps` batches (None: every pair).
        progress: show progress of the scoring pass.
        t0: when the command began, for `elapsed_s` (None: now).

    Raises:
        InputError: a malformed file or row (named), pairs that do not fit, a split that cannot
            be rebuilt.
    """
    t0 = time.perf_counter() if t0 is None else t0
    encoder = PreferenceEncoder(run.tokenizer, load_run_template(run.run_dir))
    if data is None:
        split, label = split_pairs(run, encoder)
    else:
        split, label = read_pairs(data, encoder, run.config.model.context_length), str(data)
    count = len(split) if steps is None else min(len(split), steps * batch_size)
    ref_model = None if reference is None else reference.model
    logps = score_pairs(
        run.model, ref_model, split, encoder.pad_id, batch_size, count=count, progress=progress
    )
    dpo = None if reference is None else reference.loss
    loss, figures = pair_figures(logps, dpo)
    return PreferenceEvalResult(
        run_dir=str(run.run_dir),
        weights=str(run.weights_path),
        step=run.step,
        data=label,
        reference=None if reference is None else reference.name,
        beta=None if dpo is None else dpo.beta,
        loss_type=None if dpo is None else list(dpo.types),
        loss_weights=None if dpo is None or dpo.weights is None else list(dpo.weights),
        pairs=count,
        truncated=int(split.truncated[:count].sum()),
        skipped=split.counts["skipped"],
        skipped_at=split.skipped_at,
        loss=loss,
        figures=figures,
        elapsed_s=time.perf_counter() - t0,
        per_pair=_records(split, logps),
    )


def _records(split: PreferenceSplit, logps: PairLogps) -> list[dict[str, Any]]:
    """Each scored pair's line of `--json`'s `per_pair`: where it is, whether it was cut, and
    its replies' summed log-probabilities (TRL's column names for the reference's)."""
    P = len(logps.chosen.logps)
    columns = {
        "chosen_logps": logps.chosen.logps,
        "rejected_logps": logps.rejected.logps,
        "ref_chosen_logps": logps.ref_chosen,
        "ref_rejected_logps": logps.ref_rejected,
    }
    values = {name: [None] * P if v is None else v.tolist() for name, v in columns.items()}
    return [
        {"where": split.where[i], "truncated": bool(split.truncated[i])}
        | {name: column[i] for name, column in values.items()}
        for i in range(P)
    ]


def format_preference_result(result: PreferenceEvalResult) -> str:
    """A few human-readable lines (`--json` has each pair's scores)."""
    f = result.figures
    text = (
        f"run {result.run_dir} (step {result.step}, {Path(result.weights).name})\n"
        f"data: {result.data}: {counted(result.pairs, 'preference pair')} scored "
        f"({result.truncated:,} "
        f"with their completions cut to fit, {result.skipped:,} skipped as longer than the "
        "context)\n"
    )
    if result.reference is None:
        text += (
            "no reference: --reference RUN (the run this one was fine-tuned from) adds DPO's "
            "loss and rewards\n"
        )
    else:
        types = result.loss_type or ["sigmoid"]
        weights = result.loss_weights or [1.0] * len(types)
        terms = zip(types, weights, strict=True)
        kind = " + ".join(n if w == 1.0 else f"{w:g} {n}" for n, w in terms)
        loss = "" if kind == "sigmoid" else f", loss {kind}"
        text += (
            f"against {result.reference} (beta {result.beta:g}{loss}): DPO loss "
            f"{result.loss:.4f}, "
            f"reward accuracy {100 * f['rewards/accuracies']:.1f}%, margin "
            f"{f['rewards/margins']:+.4f} (chosen {f['rewards/chosen']:+.4f}, rejected "
            f"{f['rewards/rejected']:+.4f})\n"
        )
    return text + (
        f"log-probabilities: chosen {f['logps/chosen']:.3f}, rejected {f['logps/rejected']:.3f}; "
        f"the chosen reply scores higher in {100 * f['logps/accuracies']:.1f}% of pairs"
    )
