"""The resume state: what `state.pt` holds, and its checks before a run continues from it.

`ResumeState` is what a save writes to `state.pt` and a resume reads back: the loop's counters
(`llmcli.training.counters.TrainState`), the model, the optimizer, the precision scaler, every
rank's RNG (`llmcli.training.rng`) and batch-sampler states, and the spike guard's state. It owns
the file's keys (`to_dict`), the checks on reading them back (`load`), whether a run can continue
from them (`check_fits`, and before any part is loaded `check_parts`: the weights and optimizer
state against the built run), the settings a resume changes (`changed_settings`,
`describe_changes`) and the message of a part that still does not fit (`load_part`); the
checkpointer (`llmcli.training.checkpoint`) makes one at a save and puts one back on a resume.
`llmcli.runs.formats` writes and reads the file itself (`torch.save` to a temporary name renamed
into place; `torch.load(weights_only=True)`).

Exact resume. A save records the model, the optimizer, the counters (the schedule is a function
of the step), the torch / CUDA / NumPy / Python RNG states of every rank and the batch sampler's
position. Evaluation draws from its own samplers, re-seeded at every evaluation, so it never moves
the training stream. A run resumed from a save therefore replays the same batches with the same
random numbers and, on CPU, ends with bitwise-identical weights.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmcli.config import Config
from llmcli.config.loading import set_options
from llmcli.errors import CheckpointError, InputError
from llmcli.runs.directory import CONFIG_FILE, STATE_FILE
from llmcli.runs.formats import check_weights, load_state
from llmcli.training.counters import TrainState
from llmcli.training.rng import generator_state_ok, rng_state_ok

logger = logging.getLogger(__name__)


# Settings a resume may change without changing what the run learns: where it runs and writes.
_NOT_COMPARED = {"init_from", "out_dir", "device", "threads", "compile", "logger"}
# What a changed setting does to the rest of a resumed run; others change what they name.
_EFFECTS = {
    "train.max_steps": "where the run ends, and the learning-rate schedule stretched to it",
    "train.lr": "the learning rate from here on",
    "train.min_lr": "the learning rate the schedule decays to",
    "train.warmup_steps": "the learning-rate schedule",
    "train.batch_size": "the rows each step reads, so the data order too",
    "train.grad_accum": "the rows each step reads, so the data order too",
    "train.seed": "nothing already drawn (the saved generators continue)",
}


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    """A resume's changed settings (`ResumeState.changed_settings`) as one message: each with
    its saved and new value and what it changes, and the `--set`s that keep the saved ones."""
    said = "; ".join(
        f"{key} {saved!r} -> {now!r}" + (f" ({_EFFECTS[key]})" if key in _EFFECTS else "")
        for key, saved, now in changes
    )
    keep = " ".join(arg for key, saved, _ in changes for arg in set_options(key, saved))
    return (
        f"resuming with settings that differ from the saved run's: {said}. The command's "
        "settings apply from here on (as nanoGPT's and litgpt's resumes do), so the run will not "
        f"match an uninterrupted one; to continue as it was saved, resume with {keep}."
    )


# The keys every resume state holds, with their types: checked before any of it is used.
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "config": dict,
    "model": dict,
    "optimizer": dict,
    "rng": list,
    "sampler": list,
    "step": int,
    "tokens": int,
    "elapsed_s": (int, float),
    "metrics_bytes": int,
}
# The keys a resume state may lack (`ResumeState.from_dict` gives their defaults), with the types
# they must have when present.
_OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "best_val_loss": (int, float),
    "best_step": (int, type(None)),
    "last_eval": dict,
    "eval_pending": bool,
    "vocab_size": (int, type(None)),
    "source_hash": (str, type(None)),
    "scaler": (dict, type(None)),
    "guard": (dict, type(None)),
    "head_metrics_bytes": (int, type(None)),
}


@dataclass
class ResumeState:
    """What `state.pt` holds: all a run needs to continue exactly where a save left it.

    A save builds one from the live run and writes `to_dict()` (through
    `llmcli.runs.directory.save_checkpoint`, which writes it last: the commit point of a save);
    a resume reads it back with `load`, then checks it against its config with `check_fits`.

    Attributes:
        counters: the loop's counters (the file holds their `elapsed` at the save as
            `elapsed_s`; read back, that becomes `elapsed_base`).
        metrics_bytes: the size of `metrics.jsonl` at the save; a resumed run cuts it back there.
        head_metrics_bytes: the same for `head_metrics.jsonl` (None: not recorded, by states
            written before it was; `llmcli.runs.head_metrics.cut_to_step` then cuts it).
        vocab_size: the tokenizer's size (None in a file that lacks it: `check_fits` refuses it).
        source_hash: the corpus's hash (None: unknown); a resume warns when it changed.
        config: the run's config, as `Config.to_dict()`.
        model: the model's state dict (its own copy of the weights: resuming needs no other file).
        optimizer: the optimizer's state dict.
        scaler: the GradScaler's state dict ({} for a disabled one: no loss scaling).
        rng: every rank's RNG states (`rng_state`), in rank order.
        sampler: every rank's batch-sampler state, in rank order.
        guard: the spike guard's state (`llmcli.training.guard`; None without the guard).
    """

    counters: TrainState
    metrics_bytes: int
    head_metrics_bytes: int | None
    vocab_size: int | None
    source_hash: str | None
    config: dict[str, Any]
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scaler: dict[str, Any]
    rng: list[dict[str, Any]]
    sampler: list[dict[str, Any]]
    guard: dict[str, Any] | None = None
    path: Path | None = field(default=None, compare=False)  # the file it was read from

    def to_dict(self) -> dict[str, Any]:
        """What `state.pt` holds (`save_state` adds its format tag): tensors and plain data
        only, so that it loads with `weights_only=True`."""
        counters = self.counters
        return {
            "step": counters.step,
            "tokens": counters.tokens,
            "elapsed_s": counters.elapsed,
            "best_val_loss": counters.best_val_loss,
            "best_step": counters.best_step,
            "last_eval": counters.last_eval,
            "metrics_bytes": self.metrics_bytes,
            "vocab_size": self.vocab_size,
            "source_hash": self.source_hash,
            "config": self.config,
            "model": self.model,
            "optimizer": self.optimizer,
            "scaler": self.scaler,
            "rng": self.rng,
            "sampler": self.sampler,
            "guard": self.guard,
            "head_metrics_bytes": self.head_metrics_bytes,
            "eval_pending": counters.eval_pending,
        }

    @classmethod
    def load(cls, run_dir: Path) -> ResumeState:
        """Read `run_dir`'s `state.pt` safely and check what it holds.

        Raises:
            CheckpointError: missing, unsafe, truncated, corrupt, incomplete or malformed
                (names the file and what is wrong).
        """
        path = run_dir / STATE_FILE
        if not path.is_file():
            raise CheckpointError(
                f"no resume state '{path}': nothing to resume in '{run_dir}'. Start a new run "
                "without --resume."
            )
        return cls.from_dict(load_state(path), path)

    @classmethod
    def from_dict(cls, saved: dict[str, Any], path: Path) -> ResumeState:
        """The resume state in `saved` (what `path` held), checked before any of it is used.

        Raises:
            CheckpointError: a key is missing or of the wrong type, or the ranks' RNG and
                sampler states do not pair up; names `path` and the keys.
        """
        _check_layout(saved, path)
        return cls(
            counters=TrainState(
                step=int(saved["step"]),
                tokens=int(saved["tokens"]),
                elapsed_base=float(saved["elapsed_s"]),
                best_val_loss=float(saved.get("best_val_loss", math.inf)),
                best_step=saved.get("best_step"),
                last_eval=dict(saved.get("last_eval", {})),
                eval_pending=saved.get("eval_pending", False),
                last_saved=int(saved["step"]),  # the save a run resumes from is its latest
            ),
            metrics_bytes=int(saved["metrics_bytes"]),
            head_metrics_bytes=saved.get("head_metrics_bytes"),
            vocab_size=saved.get("vocab_size"),
            source_hash=saved.get("source_hash"),
            config=saved["config"],
            model=saved["model"],
            optimizer=saved["optimizer"],
            scaler=saved.get("scaler") or {},
            rng=saved["rng"],
            sampler=saved["sampler"],
            guard=saved.get("guard"),
            path=path,
        )

    def check_fits(self, config: Config, run_dir: Path, vocab: int) -> None:
        """Refuse to resume `run_dir` with a config or tokenizer this state does not fit.

        Raises:
            CheckpointError: naming what differs, and what to do.
        """
        saved_optimizer = self.config.get("train", {}).get("optimizer", "adamw")
        if saved_optimizer != config.train.optimizer:
            raise CheckpointError(
                f"cannot resume '{run_dir}' with train.optimizer={config.train.optimizer!r}: it "
                f"was trained with {saved_optimizer!r}, whose saved state does not carry over. "
                f"Resume with --set train.optimizer={saved_optimizer}, or start a new run with "
                "--out DIR."
            )
        saved = self.config.get("model", {})
        now = config.to_dict()["model"]
        diff = [
            f"model.{k}: saved {saved.get(k)!r}, config {v!r}"
            for k, v in now.items()
            if saved.get(k) != v
        ]
        if diff:
            raise CheckpointError(
                f"cannot resume '{run_dir}': the config's model differs from the saved one "
                f"({'; '.join(diff)}). Resume with the run's own config "
                f"({run_dir / CONFIG_FILE}) or start a new run with --out DIR."
            )
        if self.vocab_size != vocab:
            raise CheckpointError(
                f"cannot resume '{run_dir}': its tokenizer has {vocab} tokens but the saved "
                f"model has {self.vocab_size}; the run's files come from different runs."
            )

    def changed_settings(self, config: Config) -> list[tuple[str, Any, Any]]:
        """The `train` and `sample` settings of `config` that differ from the saved run's, as
        `(key, saved, now)`, in the config's order (the model's are `check_fits`'s to refuse;
        a changed corpus is told by its hash)."""
        now = config.to_dict()
        return [
            (f"{section}.{key}", self.config.get(section, {}).get(key), value)
            for section in ("train", "sample")
            for key, value in now[section].items()
            if key not in _NOT_COMPARED and self.config.get(section, {}).get(key, value) != value
        ]

    def check_parts(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Check the saved weights and optimizer state against the run they go into, before
        any part is loaded: every weight's name and shape, the optimizer's groups, their
        parameters, and each parameter's moments (of its shape, the same ones in a group).

        Raises:
            CheckpointError: naming the file, the part and what does not fit.
        """
        check_weights(model, self.model, self.path or STATE_FILE, what="resume state")
        problem = _optimizer_problem(self.optimizer, optimizer)
        if problem:
            raise CheckpointError(
                f"resume state '{self.path}': its optimizer state does not fit this run "
                f"({problem}); it is damaged or was not written by this version of llmcli. "
                "Remove it to start afresh, or restore it from a backup."
            )

    def load_part(self, part: str, load: Callable[[], Any]) -> None:
        """Run `load`, which puts one part of this state into a run; what it raises on a
        malformed part is a `CheckpointError` naming the file and the part."""
        try:
            load()
        except (KeyError, IndexError, ValueError, TypeError, RuntimeError, InputError) as exc:
            text = str(exc).strip()
            reason = text.splitlines()[0].rstrip(".") if text else type(exc).__name__
            raise CheckpointError(
                f"resume state '{self.path}': its {part} state does not fit this run "
                f"({reason[:200]}); it is damaged or was not written by this version of "
                "llmcli. Remove it to start afresh, or restore it from a backup."
            ) from None


def _check_layout(saved: dict[str, Any], path: Path) -> None:
    """Raise a `CheckpointError` naming `path` and the keys of `saved` that are missing or
    wrong (see `_REQUIRED`, `_OPTIONAL`, `_malformed`), or whose ranks do not pair up."""
    bad = [k for k, kind in _REQUIRED.items() if not _is(saved.get(k), kind)]
    bad += [k for k, kind in _OPTIONAL.items() if k in saved and not _is(saved[k], kind)]
    bad += [] if bad else _malformed(saved)
    if bad:
        raise CheckpointError(
            f"resume state '{path}' is incomplete or malformed (missing or wrong: "
            f"{', '.join(bad)}); it was not written by this version of llmcli. Remove it to "
            "start afresh, or restore it from a backup."
        )


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    """`isinstance`, but a bool is no int (`True` is no step count)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


SECTIONS_SAVED = ("model", "data", "train", "sample")


def _plain(value: Any) -> bool:
    """Whether `value` is YAML data: None, a bool, number or string, or a list or a mapping
    (`train.lora`) of them."""
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str))


def _malformed(saved: dict[str, Any]) -> list[str]:
    """The keys of a state of the right types whose insides are wrong: negative counters, a
    config without its sections, an optimizer state without its parts, RNG states that lack one
    of the generators, ranks whose RNG and sampler states do not pair up."""
    bad = [k for k in ("step", "tokens", "metrics_bytes") if saved[k] < 0]
    if (saved.get("head_metrics_bytes") or 0) < 0:
        bad.append("head_metrics_bytes")
    config = saved["config"]
    sections_ok = all(isinstance(config.get(s), dict) for s in ("model", "train"))
    if not (sections_ok and all(isinstance(config.get(s, {}), dict) for s in ("data", "sample"))):
        bad.append("config")
    elif not all(_plain(v) for s in SECTIONS_SAVED for v in config.get(s, {}).values()):
        bad.append("config")  # a config is YAML data: no tensors or other objects in it
    optimizer = saved["optimizer"]
    if not (
        isinstance(optimizer.get("state"), dict) and isinstance(optimizer.get("param_groups"), list)
    ):
        bad.append("optimizer")
    rng, sampler = saved["rng"], saved["sampler"]
    if not (rng and len(rng) == len(sampler) and all(isinstance(x, dict) for x in rng + sampler)):
        return [*bad, "rng", "sampler"]
    if not all(rng_state_ok(x) for x in rng):
        bad.append("rng")
    if not all(
        generator_state_ok(x.get("rng_state")) and _is_count(x.get("batches", 0)) for x in sampler
    ):
        bad.append("sampler")
    return bad


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _optimizer_problem(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> str | None:
    """What keeps `saved` (an optimizer's `state_dict()`) from `optimizer`, or None: the number
    of groups and of parameters in each, and every parameter's state (see `_state_problem`)."""
    groups, live = saved["param_groups"], optimizer.param_groups
    if len(groups) != len(live):
        return f"{len(groups)} parameter groups, the run has {len(live)}"
    shapes: dict[int, tuple[int, ...]] = {}  # parameter id -> the run's parameter's shape
    group_of: dict[int, int] = {}
    for i, (group, ours) in enumerate(zip(groups, live, strict=True)):
        ids = group.get("params") if isinstance(group, dict) else None
        if not (isinstance(ids, list) and all(_is_count(x) for x in ids)):
            return f"parameter group {i} has no list of parameter ids"
        if len(ids) != len(ours["params"]):
            return f"parameter group {i} has {len(ids)} parameters, the run's {len(ours['params'])}"
        shapes.update(zip(ids, (tuple(p.shape) for p in ours["params"]), strict=True))
        group_of.update(dict.fromkeys(ids, i))
    if len(shapes) != sum(len(g["params"]) for g in groups):
        return "a parameter id appears twice"
    return _state_problem(saved["state"], shapes, group_of)


def _state_problem(
    state: dict[Any, Any], shapes: dict[int, tuple[int, ...]], group_of: dict[int, int]
) -> str | None:
    """What is wrong with an optimizer's per-parameter state, or None: each entry belongs to a
    parameter and holds tensors of its shape, scalar tensors or numbers, under the same keys
    as the other parameters of its group that have state (a step would miss a moment)."""
    keys: dict[int, set[str]] = {}
    for pid, entry in state.items():
        if pid not in shapes or not isinstance(entry, dict):
            return f"the state of parameter {pid!r} is not a mapping of a parameter it has"
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.ndim and value.shape != shapes[pid]:
                return (
                    f"parameter {pid}'s {key!r} has shape {tuple(value.shape)}, not {shapes[pid]}"
                )
            if not isinstance(value, (torch.Tensor, int, float)) or isinstance(value, bool):
                return f"parameter {pid}'s {key!r} is a {type(value).__name__}"
        others = keys.setdefault(group_of[pid], set(entry))
        if others != set(entry):
            return (
                f"parameter {pid} has state {sorted(entry)}, others of its group {sorted(others)}"
            )
    return None
