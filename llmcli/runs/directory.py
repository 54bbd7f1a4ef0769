"""The run directory's life: its files, where it is, a fresh start or a resume, and each save.

A run directory (`checkpoints/<config name>/` by default) holds:

| file | written | what it is |
| --- | --- | --- |
| `config.yaml` | once, at the start | the fully resolved config that produced the run |
| `tokenizer.json` | once, at the start | the tokenizer: enough to encode and decode alone |
| `chat_template.jinja` | once, at the start | with `data.format: chat`: the chat template the run |
| | | was trained with, read by `chat`, `serve` and the exports (`llmcli.data.chat_template`) |
| `model.safetensors` | every save | the weights at the last save (evaluation, end, Ctrl-C) |
| `best.safetensors` | when val improves | the weights with the lowest val loss so far |
| `meta.json` | every save | step, tokens, elapsed time, val losses, library versions |
| `state.pt` | every save, last | resume state: weights, optimizer, schedule step, RNG and |
| | | batch-sampler states; read with `torch.load(weights_only=True)` |
| `metrics.jsonl` | every log step | one JSON object per logged step and per evaluation |
| `head_metrics.jsonl` | every evaluation | with `train.head_metrics`: each head's scores on the |
| | | repeated-token probe, the loss by position (`llmcli.runs.head_metrics`) |
| `loss.png` | every evaluation | train and val loss against steps |
| `adapter_config.json`, | every save | with `train.lora` on a model GPT-2 computes and no new |
| `adapter_model.safetensors` | | tokens: the adapters alone, in PEFT's format (`llmcli.hf.lora`) |

With `train.logger` the trackers add `tensorboard/`, `wandb/` and `wandb_run_id`
(`llmcli.runs.trackers`). A run starts only in a new or empty folder, or one holding nothing but
these files (an earlier run's, removed or replaced): other files are the user's, and a start
beside them needs `--overwrite`, which keeps them.

Every file is written to a temporary name in the same folder, flushed to disk (fsync) and renamed
into place (`os.replace`), so a crash at any instant leaves either the old or the new file, never a
half-written one. `state.pt` is written last at each save and holds its own copy of the weights:
it is the commit point of a save, and resuming needs nothing else, so a run killed between two
files of a save still resumes exactly from the previous save. What each file holds and how it is
read back safely: `llmcli.runs.formats`; reading a run: `llmcli.runs.loading`.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmcli.claim import LOCK_FILE, claimed_folder, missing_folders, note_path
from llmcli.config import Config, dump_yaml
from llmcli.data.chat_template import TEMPLATE_FILE, ChatTemplate
from llmcli.data.tokenizer import Tokenizer
from llmcli.errors import CheckpointError, describe_os_error
from llmcli.fileio import TMP_GLOB, atomic_write_bytes, atomic_write_json, atomic_write_text
from llmcli.model.gpt import Transformer
from llmcli.runs import versions
from llmcli.runs.formats import read_meta, save_state, weights_bytes
from llmcli.runs.trackers import TENSORBOARD_DIR, WANDB_DIR, WANDB_ID_FILE

CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
MODEL_FILE = "model.safetensors"
BEST_FILE = "best.safetensors"
META_FILE = "meta.json"
STATE_FILE = "state.pt"
METRICS_FILE = "metrics.jsonl"
HEAD_METRICS_FILE = "head_metrics.jsonl"
PLOT_FILE = "loss.png"
# A LoRA run's adapters alone, in PEFT's format (`llmcli.hf.lora`)
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
# ... and the best step's adapters in llmcli's names (the resume state holds the last save's)
BEST_ADAPTER_FILE = "best_adapter.safetensors"


def default_run_dir(config: Config) -> Path:
    """`train.out_dir`, else `checkpoints/<config file stem>`."""
    return Path(config.train.out_dir) if config.train.out_dir else Path("checkpoints") / config.name


# Files of a run that a fresh start in its folder removes (config.yaml and tokenizer.json are
# rewritten at every start; chat_template.jinja only by a chat run, so a plain-text run started
# where a chat run was must not keep it).
_RUN_FILES = (
    TEMPLATE_FILE,
    MODEL_FILE,
    BEST_FILE,
    STATE_FILE,
    META_FILE,
    METRICS_FILE,
    HEAD_METRICS_FILE,
    PLOT_FILE,
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    BEST_ADAPTER_FILE,
)
_WRITE_TEST = ".write-test"  # `ensure_run_dir`'s probe
# Every name a run writes at the top of its folder (temporary files aside); anything else there
# is someone else's.
_WRITTEN = frozenset(
    (
        CONFIG_FILE,
        TOKENIZER_FILE,
        *_RUN_FILES,
        TENSORBOARD_DIR,
        WANDB_DIR,
        WANDB_ID_FILE,
        _WRITE_TEST,
        LOCK_FILE,
        note_path(Path(LOCK_FILE)).name,
    )
)


def resumes(run_dir: Path, resume: bool | str) -> bool:
    """Whether a start continues the run in `run_dir`: `resume` is True, or "auto" and the
    folder holds a resume state (what else it holds is checked as for a fresh start)."""
    return resume is True or (resume == "auto" and (run_dir / STATE_FILE).is_file())


def _holds_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds a saved run: its resume state or its weights."""
    return (run_dir / STATE_FILE).exists() or (run_dir / MODEL_FILE).exists()


def foreign_files(run_dir: Path) -> list[str]:
    """The names in `run_dir` that no run writes (the user's files, or another tool's), sorted,
    a folder's ending in "/". A missing folder, or a path that is not a folder, has none.

    Raises:
        CheckpointError: the folder cannot be listed.
    """
    if not run_dir.is_dir():
        return []
    try:
        entries = list(run_dir.iterdir())
    except OSError as exc:
        raise CheckpointError(
            f"cannot list output directory '{run_dir}': {describe_os_error(exc)}."
        ) from None
    return sorted(
        entry.name + ("/" if entry.is_dir() else "")
        for entry in entries
        if entry.name not in _WRITTEN
        and not fnmatch.fnmatch(entry.name, TMP_GLOB)  # a killed save's, removed at the start
    )


@contextlib.contextmanager
def claim_run_dir(run_dir: Path) -> Iterator[None]:
    """Hold the run directory's claim while a run writes it (`llmcli.claim`): a second run into
    it is refused at once, naming this one. A folder made here for the claim is removed again if
    the run leaves nothing else in it (a start refused for bad input).

    Raises:
        CheckpointError: the folder cannot be made or written.
        Busy: another process is writing the run.
    """
    made = missing_folders(run_dir)
    ensure_run_dir(run_dir)
    with claimed_folder(
        run_dir,
        made,
        f"the run directory '{run_dir}'",
        fix="Wait for that run to end (or stop it: Ctrl-C saves a checkpoint) and continue it "
        "with --resume, or write this run elsewhere with --out DIR.",
    ):
        yield


def prepare_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Check the run directory can be written and holds what `resume` / `overwrite` expect.

    A fresh start (`overwrite`, or a folder without a run) removes the files of an earlier run,
    and only those: files that a run does not write are kept, even with `overwrite`.

    Raises:
        CheckpointError: nothing to resume, a run already there, files that are not a run's
            (without `overwrite`), or an unwritable folder.
    """
    if resume:
        if not (run_dir / STATE_FILE).is_file():
            raise CheckpointError(
                f"--resume: nothing to resume in '{run_dir}' (no {STATE_FILE}; a run saves "
                "one at its first evaluation). Start it without --resume."
            )
        ensure_run_dir(run_dir)
        return
    if not overwrite:
        check_fresh_start(run_dir)
    ensure_run_dir(run_dir)
    for name in _RUN_FILES:
        with contextlib.suppress(FileNotFoundError):
            (run_dir / name).unlink()


def check_fresh_start(run_dir: Path) -> None:
    """Refuse to start a run, without `--overwrite`, where it would replace a run or mix with
    other files (as Hugging Face's Trainer refuses a non-empty output_dir)."""
    if _holds_run(run_dir):
        meta = read_meta(run_dir / META_FILE)
        at = f" (step {meta['step']})" if "step" in meta else ""
        raise CheckpointError(
            f"'{run_dir}' already holds a run{at}: continue it with --resume, start it afresh "
            "with --overwrite, or write elsewhere with --out DIR."
        )
    others = foreign_files(run_dir)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise CheckpointError(
            f"'{run_dir}' is not empty and holds no llmcli run: it has {shown}. Write the run "
            "to a new or empty folder with --out DIR (or train.out_dir), or pass --overwrite "
            "to write it beside them (files a run does not write are kept)."
        )


def ensure_run_dir(run_dir: str | Path) -> Path:
    """Create `run_dir` (and parents) and check that files can be written there.

    Raises:
        CheckpointError: the folder cannot be created or written (names it and the reason).
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise CheckpointError(
            f"output path '{run_dir}' exists and is not a directory: choose another --out "
            "or remove that file."
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(run_dir / _WRITE_TEST, b"")
        (run_dir / _WRITE_TEST).unlink()
    except OSError as exc:
        raise CheckpointError(
            f"cannot write to output directory '{run_dir}': {exc.strerror or exc}. "
            "Choose a writable folder with --out DIR (or train.out_dir)."
        ) from None
    return run_dir


def write_config(run_dir: Path, config: Config) -> None:
    """Write `config.yaml` atomically."""
    atomic_write_text(run_dir / CONFIG_FILE, dump_yaml(config))


def write_config_and_tokenizer(
    run_dir: Path, config: Config, tokenizer: Tokenizer, template: ChatTemplate | None = None
) -> None:
    """Write `config.yaml` and `tokenizer.json` (and a chat run's `chat_template.jinja`)
    atomically."""
    write_config(run_dir, config)
    atomic_write_text(run_dir / TOKENIZER_FILE, tokenizer.to_json())
    if template is not None:
        template.save(run_dir)


def save_checkpoint(
    run_dir: str | Path,
    model: Any,
    state: dict[str, Any],
    meta: dict[str, Any],
    *,
    best: bool,
    previous_step: int = -1,
    extra_files: dict[str, bytes] | None = None,
) -> None:
    """One save of a training run: weights, best weights (if `best`), `extra_files`, meta, then
    resume state.

    `state.pt` is written last: it is the commit point. A crash before it leaves the previous
    resume state, which holds its own weights, so resuming is exact either way.

    Args:
        run_dir: the run directory (exists, with config.yaml and tokenizer.json).
        model: the unwrapped model, or the state dict of the weights readers get (a LoRA
            run's merged weights), which go to `model.safetensors`.
        state: the resume state, as `llmcli.training.state.ResumeState.to_dict()` gives it.
        meta: the `meta.json` content (must include "step" and "vocab_size").
        best: also write the weights to `best.safetensors`.
        previous_step: the step of the previous save (-1: none), named if this one fails.
        extra_files: more files of the save by name (a LoRA run's PEFT adapter).

    Raises:
        CheckpointError: a write failed (the file being written keeps its previous content);
            the message names the reason and the previous checkpoint, which is intact.
    """
    run_dir = Path(run_dir)
    try:
        data = weights_bytes(model, {"step": meta["step"], "vocab_size": meta["vocab_size"]})
        atomic_write_bytes(run_dir / MODEL_FILE, data)
        if best:
            atomic_write_bytes(run_dir / BEST_FILE, data)
        for name, content in (extra_files or {}).items():
            atomic_write_bytes(run_dir / name, content)
        atomic_write_json(run_dir / META_FILE, meta)
        save_state(run_dir / STATE_FILE, state)
    except OSError as exc:
        previous = f"step {previous_step}" if previous_step >= 0 else "none yet"
        raise CheckpointError(
            f"could not save the checkpoint of step {meta['step']} in '{run_dir}': "
            f"{describe_os_error(exc)}. The previous checkpoint ({previous}) is "
            "intact; fix the problem and continue with --resume."
        ) from None


def save_model_run(
    run_dir: str | Path,
    config: Config,
    tokenizer: Tokenizer,
    model: Transformer,
    *,
    extra_meta: dict[str, Any] | None = None,
) -> None:
    """Write a complete readable run (no resume state): config, tokenizer, weights, meta.

    `model.safetensors` and `best.safetensors` both get the given weights. Used to package a
    model without training (tests of the readers, imported weights).

    Args:
        run_dir: the folder to write (created if needed).
        config: the config that describes `model`.
        tokenizer: an llmcli tokenizer (has `.to_json()` and `.vocab_size`).
        model: a `Transformer` built from `config.model`.
        extra_meta: merged into `meta.json` (for example `{"step": 100}`).
    """
    run_dir = ensure_run_dir(run_dir)
    meta = {"step": 0, "vocab_size": int(tokenizer.vocab_size), "versions": versions.record()}
    meta.update(extra_meta or {})
    write_config_and_tokenizer(run_dir, config, tokenizer)
    data = weights_bytes(model, {"step": meta["step"], "vocab_size": meta["vocab_size"]})
    atomic_write_bytes(run_dir / MODEL_FILE, data)
    atomic_write_bytes(run_dir / BEST_FILE, data)
    atomic_write_json(run_dir / META_FILE, meta)
