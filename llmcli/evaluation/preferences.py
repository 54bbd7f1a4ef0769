"""`llmcli eval` on preference pairs: how a run ranks the chosen and rejected replies of each
pair, measured as DPO measures it (`llmcli.evaluation.preference_scores`).

The pairs are a JSONL file of TRL's rows (`llmcli.data.preferences`: `{"prompt", "chosen",
"rejected"}`, text or messages), or, with no file, a DPO run's own validation pairs as training
split them (`llmcli.data.preference_data`). They are encoded with the run's tokenizer and chat
template as DPO encodes them, and fitted to the context as training fits them: a pair too long
has both completions cut to the room its prompt leaves, or is skipped (both counted). Every pair
is then scored once, in order, `batch_size` pairs a batch: each reply's summed completion
log-probability under the run's model and, where there is one, under the reference.

The reference is what DPO's rewards are measured against: a DPO run's `train.init_from`, loaded
as training loads it, or any run with the same tokenizer (`--reference`). Against it come
DPO's loss (the mean over pairs, beta the run's `train.dpo_beta`) and TRL's metrics:
`rewards/accuracies`, `rewards/margins`, `rewards/chosen`, `rewards/rejected`. Without one
(a run not trained with DPO, and no `--reference`), only the run's own figures: `logps/chosen`
and `logps/rejected` (mean summed log-probabilities), and `logps/accuracies`, the share of pairs
whose chosen reply the model scores strictly higher, a before/after figure of a DPO run and
the run it started from.

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
from torch import Tensor, nn

from llmcli.config import Config
from llmcli.data.chat_template import load_run_template
from llmcli.data.preference_data import (
    PreferenceSplit,
    encode_split,
    pair_batch,
    prepare_preference_data,
)
from llmcli.data.preferences import KEYS, SHAPE, PreferenceEncoder, read_preferences
from llmcli.data.tokenizer import Tokenizer
from llmcli.errors import InputError
from llmcli.evaluation.chat import is_conversations
from llmcli.evaluation.preference_scores import completion_logps, dpo_loss
from llmcli.fileio import refuse_special_file
from llmcli.progress import Progress, counted
from llmcli.runs.directory import CONFIG_FILE
from llmcli.runs.loading import LoadedRun, load_run, load_tokenizer_file

# Builds a DPO run's frozen reference from its config, vocabulary size and device: training's
# own (`llmcli.training.dpo.reference_model`), which the command line passes in, since
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
    """The model DPO's rewards are measured against, how the result names it, and DPO's beta."""

    model: nn.Module
    name: str
    beta: float


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
    beta = run.config.train.dpo_beta
    if reference is not None:
        other = load_run(reference, device=device, notify=notify)
        check_same_tokenizer(run, other.tokenizer, f"--reference '{other.run_dir}'")
        return Reference(other.model, str(other.run_dir), beta)
    init_from = run.config.train.init_from
    if run.config.train.objective != "dpo" or init_from is None:
        return None
    if load_dpo_reference is None:
        raise ValueError(
            "a DPO run's pairs are scored against its train.init_from: pass load_dpo_reference "
            "(llmcli.training.dpo.reference_model), or a reference run."
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
    return Reference(load_dpo_reference(run.config, vocab_size, device), init_from, beta)


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


@dataclass
class PairLogps:
    """Each scored pair's summed completion log-probabilities, `(P,)` float32 each: the run's
    model's, and the reference's (None without one)."""

    chosen: Tensor
    rejected: Tensor
    ref_chosen: Tensor | None = None
    ref_rejected: Tensor | None = None


@torch.no_grad()
def score_pairs(
    model: nn.Module,
    reference: nn.Module | None,
    split: PreferenceSplit,
    pad_id: int,
    batch_size: int,
    *,
    count: int | None = None,
    length: int | None = None,
    progress: bool = False,
) -> PairLogps:
    """The first `count` pairs of `split` (None: all) scored in order, `batch_size` at a time,
    each batch padded to its longest sequence (`pair_batch`; or to `length` tokens, as training
    pads them, which gives its steps' scores to the last bit): attention is causal, so the
    padding after a sequence changes none of its logits, and it is never in the mask."""
    device = next(model.parameters()).device
    count = len(split) if count is None else min(count, len(split))
    starts = range(0, count, batch_size)
    bar = Progress(len(starts), desc="eval", unit="batch", enabled=progress, tenths=True)
    scores: dict[str, list[Tensor]] = {"policy": [], "reference": []}
    for lo in starts:
        picks = range(lo, min(lo + batch_size, count))
        ids, mask = pair_batch(split, picks, pad_id, length)  # (2B, L)
        ids, mask = ids.to(device), mask.to(device)
        scores["policy"].append(completion_logps(model, ids, mask).cpu())  # (2B,)
        if reference is not None:
            scores["reference"].append(completion_logps(reference, ids, mask).cpu())  # (2B,)
        bar.update()
    bar.close()
    chosen, rejected = _halves(scores["policy"])
    if reference is None:
        return PairLogps(chosen, rejected)
    return PairLogps(chosen, rejected, *_halves(scores["reference"]))


def _halves(batches: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The chosen and rejected scores `(P,)` of batches of `(2B,)` (chosen rows first)."""
    halves = [batch.chunk(2) for batch in batches]
    return torch.cat([c for c, _ in halves]), torch.cat([r for _, r in halves])


def pair_figures(logps: PairLogps, beta: float | None) -> tuple[float | None, dict[str, Any]]:
    """DPO's loss over the pairs (None without a reference) and `FIGURES`, each a mean over
    the pairs (the rewards None without a reference)."""
    chosen, rejected = logps.chosen, logps.rejected
    figures: dict[str, Any] = dict.fromkeys(FIGURES)
    loss = None
    if logps.ref_chosen is not None and logps.ref_rejected is not None and beta is not None:
        value, metrics = dpo_loss(chosen, rejected, logps.ref_chosen, logps.ref_rejected, beta)
        loss = value.item()
        figures.update({name: metric.item() for name, metric in metrics.items()})
    figures["logps/chosen"] = chosen.mean().item()
    figures["logps/rejected"] = rejected.mean().item()
    figures["logps/accuracies"] = (chosen > rejected).float().mean().item()
    return loss, figures


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
    beta = None if reference is None else reference.beta
    loss, figures = pair_figures(logps, beta)
    return PreferenceEvalResult(
        run_dir=str(run.run_dir),
        weights=str(run.weights_path),
        step=run.step,
        data=label,
        reference=None if reference is None else reference.name,
        beta=beta,
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
    P = len(logps.chosen)
    columns = {
        "chosen_logps": logps.chosen,
        "rejected_logps": logps.rejected,
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
        text += (
            f"against {result.reference} (beta {result.beta:g}): DPO loss {result.loss:.4f}, "
            f"reward accuracy {100 * f['rewards/accuracies']:.1f}%, margin "
            f"{f['rewards/margins']:+.4f} (chosen {f['rewards/chosen']:+.4f}, rejected "
            f"{f['rewards/rejected']:+.4f})\n"
        )
    return text + (
        f"log-probabilities: chosen {f['logps/chosen']:.3f}, rejected {f['logps/rejected']:.3f}; "
        f"the chosen reply scores higher in {100 * f['logps/accuracies']:.1f}% of pairs"
    )
