"""Experiment trackers: the records of `metrics.jsonl`, sent to TensorBoard or Weights & Biases too.

`train.logger` names the trackers (`none`, `tensorboard`, `wandb`, or several). Each receives
every record the training loop writes to `metrics.jsonl` (rank 0 only), with the same values:

- a train step: `train/loss`, `train/lr`, `train/grad_norm`, `train/tokens_per_s`,
  `progress/tokens`, `progress/elapsed_s`;
- an evaluation: `eval/train_loss`, `eval/val_loss`, `eval/val_ppl`, and with
  `train.head_metrics` `eval/icl_score`, `heads/induction_max`, `heads/prev_token_max`;
- with `train.objective: dpo`, TRL's names under those groups: `train/rewards/accuracies`, ...,
  and `eval/val_rewards/accuracies`, `eval/train_rewards/accuracies`, ...;
- with `train.log_layers`, a train step also: `layers/<group>/grad_norm`,
  `layers/<group>/update_ratio` (`llmcli.training.layers`);
- a spike-guard event (`llmcli.training.guard`): `guard/skipped_loss`, or `guard/rollback_loss`
  and `guard/rollbacks`;

(TensorBoard tags and W&B keys alike), at the record's step. After a rollback the steps run
again are logged again at the same steps.

- TensorBoard writes event files into `<run>/tensorboard/` through
  `torch.utils.tensorboard.SummaryWriter`. A resumed run purges the steps after the one it
  resumes from (`purge_step`), so the curves have no duplicated or out-of-order points.
- W&B logs through `wandb` (`WANDB_MODE=offline` keeps everything local); the W&B run id is kept
  in `<run>/wandb_run_id`, so that `--resume` continues the same W&B run.

The packages are optional extras (`pip install llmcli[tensorboard]`, `llmcli[wandb]`): they are
imported only when a tracker is asked for, and `check_available` says which extra is missing
before training starts. A tracker that fails mid-run (a full disk, a W&B error) warns once and is
dropped: `metrics.jsonl` stays the record.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import shutil
import uuid
from pathlib import Path
from typing import Any, Protocol

from llmcli.config import Config
from llmcli.errors import InputError
from llmcli.fileio import atomic_write_text

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"  # where `wandb.init(dir=run_dir)` keeps its own files
WANDB_ID_FILE = "wandb_run_id"
# The package each tracker needs, the module it imports, and the extra that installs it.
_PACKAGES = {
    "tensorboard": ("tensorboard", "torch.utils.tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb", "wandb"),
}
_TRAIN_TAGS = {
    "train_loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tok_per_s": "train/tokens_per_s",
    "mfu": "train/mfu",
    "tokens": "progress/tokens",
    "elapsed_s": "progress/elapsed_s",
}
_EVAL_TAGS = {
    "train_loss": "eval/train_loss",
    "val_loss": "eval/val_loss",
    "val_ppl": "eval/val_ppl",
    "icl_score": "eval/icl_score",
    "induction_max": "heads/induction_max",
    "prev_token_max": "heads/prev_token_max",
}


def tags(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of a `metrics.jsonl` record under their tracker tags (step and kind aside)."""
    kind = record.get("kind")
    if kind == "event":  # a spike-guard event: its loss, and a rollback's count
        names = {"loss": f"guard/{record.get('event')}_loss", "rollback": "guard/rollbacks"}
    else:
        names = _EVAL_TAGS if kind == "eval" else _TRAIN_TAGS
    scalars = {tag: float(record[key]) for key, tag in names.items() if _is_number(record.get(key))}
    group = "eval" if kind == "eval" else "train"
    for key, value in record.items():  # an objective's metrics, named as TRL names them
        if "/" in key and _is_number(value):  # DPO's rewards/margins, eval's val_rewards/margins
            scalars[f"{group}/{key}"] = float(value)
    for group, values in (record.get("layers") or {}).items():  # train.log_layers
        for key, value in values.items():
            if _is_number(value):
                scalars[f"layers/{group}/{key}"] = float(value)
    return scalars


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_available(names: list[str]) -> None:
    """Refuse a tracker whose package is missing or does not import, before anything is
    written: it imports what the tracker imports, and names the extra that installs it.

    Raises:
        InputError: the package is not installed (`pip install 'llmcli[<extra>]'`), or it is
            and importing it fails (the message gives the error).
    """
    for name in names:
        package, module, extra = _PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise InputError(
                f"train.logger {name!r} needs the {package} package, which is not installed: "
                f"pip install 'llmcli[{extra}]' (or set train.logger: none)."
            )
        try:
            importlib.import_module(module)
        except Exception as exc:  # a broken install fails in its own ways (ImportError and more)
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise InputError(
                f"train.logger {name!r}: the {package} package is installed but `import "
                f"{module}` fails ({type(exc).__name__}: {first}). Reinstall it (pip install "
                f"--force-reinstall 'llmcli[{extra}]') or set train.logger: none."
            ) from None


class Tracker(Protocol):
    name: str

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars into `<run>/tensorboard/` (a resumed run purges the steps it writes again)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, resumed_from: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # optional: llmcli[tensorboard]

        log_dir = run_dir / TENSORBOARD_DIR
        if resumed_from is None:  # a fresh start: an earlier run's curves would mix with its own
            shutil.rmtree(log_dir, ignore_errors=True)
        purge = resumed_from + 1 if resumed_from is not None else None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def log(self, record: dict[str, Any]) -> None:
        for tag, value in tags(record).items():
            self.writer.add_scalar(tag, value, global_step=record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run, resumed by the id kept in the run directory."""

    name = "wandb"

    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any],
        project: str,
        name: str,
        resumed_from: int | None,
    ) -> None:
        import wandb  # optional: llmcli[wandb]

        id_file = run_dir / WANDB_ID_FILE
        resume = resumed_from is not None and id_file.is_file()  # a fresh start: a new W&B run
        run_id = id_file.read_text().strip() if resume else uuid.uuid4().hex[:12]
        try:
            self.run = wandb.init(
                project=project,
                name=name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                config=config,
            )
        except wandb.errors.Error as exc:  # no API key, no network, a bad project name...
            raise InputError(
                f"W&B could not start a run: {str(exc).rstrip('. ')}. Log in (`wandb login` or "
                "WANDB_API_KEY), set WANDB_MODE=offline to log locally, or choose another "
                "train.logger."
            ) from None
        if not resume:
            atomic_write_text(id_file, run_id + "\n")

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(tags(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The trackers of a run, each dropped (with one warning) at its first failure."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, record: dict[str, Any]) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.log(record)
            except Exception as exc:  # any failure of an optional tracker must not stop training
                self._drop(tracker, exc)

    def close(self) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.close()
            except Exception as exc:  # closing is best effort: metrics.jsonl has everything
                self._drop(tracker, exc)

    def _drop(self, tracker: Tracker, exc: BaseException) -> None:
        self.trackers.remove(tracker)
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        logger.warning(
            "%s logging failed (%s); training goes on, metrics.jsonl keeps every record",
            tracker.name,
            first,
        )


def open_trackers(config: Config, run_dir: Path, resumed_from: int | None) -> Trackers | None:
    """Start the trackers `train.logger` names for a run (None for none; call
    `check_available` first). W&B's project and run name default to the config's and the run
    directory's names."""
    tc = config.train
    trackers: list[Tracker] = []
    for tracker in tc.loggers:
        if tracker == "tensorboard":
            trackers.append(TensorBoardTracker(run_dir, resumed_from))
        elif tracker == "wandb":
            project, name = tc.wandb_project or config.name, tc.wandb_name or run_dir.name
            trackers.append(WandbTracker(run_dir, config.to_dict(), project, name, resumed_from))
    return Trackers(trackers) if trackers else None
