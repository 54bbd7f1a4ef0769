"""Reference curves: the validation loss a shipped config reaches against tokens, measured once.

Each shipped config `configs/<name>.yaml` carries `configs/references/<name>.json` (package data
in a wheel, beside the configs): the eval points of a measured run of that config (step, tokens,
elapsed seconds, val loss), the run's resolved config, and where, when and how it was measured. A
config too slow to measure on the machines the references came from carries a file with no points
and a note saying why.

`reference_from_run` makes such a file from a run directory (`benchmarks/reference_curve.py`
writes it); `check_run` places a run against its config's reference: how far its last evaluation
lies above or below the reference interpolated in tokens, and which of the config keys that change
the curve differ from the reference run's.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmcli.config import config_from_dict, shipped_configs, shipped_dir
from llmcli.errors import InputError
from llmcli.fileio import JSONFileError, read_json
from llmcli.runs.directory import META_FILE, METRICS_FILE
from llmcli.runs.formats import read_meta
from llmcli.runs.loading import load_config_file
from llmcli.runs.metrics import read_metrics

FORMAT = 1
REFERENCES = "references"  # the folder beside the shipped configs
# The train keys that change the curve of val loss against tokens: the optimizer, its rates and
# schedule, the batch, the length of the run (the schedule's shape depends on it) and a starting
# checkpoint. Every model and data key changes it too, except where the token cache lives. The
# rest (device, precision, seed, logging, evaluation, saving, trackers) move it by noise at most.
TRAIN_CURVE_KEYS = (
    "batch_size",
    "grad_accum",
    "max_steps",
    "optimizer",
    "lr",
    "min_lr",
    "warmup_steps",
    "schedule",
    "decay_fraction",
    "weight_decay",
    "beta1",
    "beta2",
    "grad_clip",
    "muon_lr",
    "muon_momentum",
    "init_from",
)
NOT_CURVE_KEYS = ("data.cache_dir",)
# Corpora are compared by file name: the same corpus sits in another folder on every machine.
PATH_KEYS = ("data.path", "data.val_path")


@dataclass
class Reference:
    """A shipped config's reference curve, read from its JSON file.

    Attributes:
        name: the shipped config's name (`tiny`).
        path: the file it was read from.
        points: the measured run's evaluations, in token order: dicts with `step`, `tokens`,
            `elapsed_s` and `val_loss`; empty when the config has no measured curve.
        config: the measured run's resolved config (sections of keys).
        measured: date, commit, device, dtype, world_size, seed, steps, tokens, elapsed_s.
        note: why there are no points, or anything else a reader should know.
    """

    name: str
    path: Path
    points: list[dict[str, Any]]
    config: dict[str, Any]
    measured: dict[str, Any]
    note: str | None = None


@dataclass
class ReferenceCheck:
    """Where a run stands against its config's reference (`check_run`).

    `missing` says why there is nothing to compare with (no shipped name, no curve, no
    evaluation yet); the other fields are then None or empty. `offset` is the run's val loss
    minus the reference's at `tokens` (positive: above the reference, worse); `relative` is it
    over the reference's value. `differs` maps each differing curve key to [run's value,
    reference's value].
    """

    name: str | None
    matched_by: str | None = None
    path: str | None = None
    measured: dict[str, Any] = field(default_factory=dict)
    tokens: int | None = None
    run_val_loss: float | None = None
    reference_val_loss: float | None = None
    offset: float | None = None
    relative: float | None = None
    differs: dict[str, list[Any]] = field(default_factory=dict)
    note: str | None = None
    missing: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def references_dir() -> Path:
    """The folder of the reference curves, installed or in a checkout."""
    return shipped_dir("configs") / REFERENCES


def load_reference(name: str) -> Reference | None:
    """The reference of the shipped config `name` (None: it has no file).

    Raises:
        InputError: a reference file that is not a valid reference (a broken installation).
    """
    path = references_dir() / f"{name}.json"
    if not path.is_file():
        return None
    try:
        raw = read_json(path)
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT}")
        points = sorted(raw["points"], key=lambda p: p["tokens"])
        if not all(isinstance(p["tokens"], int) and math.isfinite(p["val_loss"]) for p in points):
            raise ValueError("a point without whole tokens or a finite val_loss")
        return Reference(name, path, points, raw["config"], raw["measured"], raw.get("note"))
    except (JSONFileError, ValueError, KeyError, TypeError, AttributeError) as exc:
        cause = exc.cause if isinstance(exc, JSONFileError) else exc
        raise InputError(
            f"the reference curve '{path}' is unreadable ({cause}): this installation of llmcli "
            "is incomplete or was edited; reinstall it."
        ) from None


def eval_points(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run's evaluations with a finite val loss, one per token count (the last), in order."""
    by_tokens: dict[int, dict[str, Any]] = {}
    for r in records:
        val, tokens = r.get("val_loss"), r.get("tokens")
        if r.get("kind") != "eval" or not isinstance(tokens, int):
            continue
        if isinstance(val, (int, float)) and math.isfinite(val):
            by_tokens[tokens] = {
                "step": r.get("step"),
                "tokens": tokens,
                "elapsed_s": r.get("elapsed_s"),
                "val_loss": float(val),
            }
    return [by_tokens[t] for t in sorted(by_tokens)]


def interpolate(points: list[dict[str, Any]], tokens: float) -> float | None:
    """The val loss at `tokens`, linear between the points around it (None outside them)."""
    xs = [p["tokens"] for p in points]
    if not xs or tokens < xs[0] or tokens > xs[-1]:
        return None
    i = bisect.bisect_left(xs, tokens)
    if xs[i] == tokens:
        return points[i]["val_loss"]
    (x0, y0), (x1, y1) = (
        (xs[i - 1], points[i - 1]["val_loss"]),
        (xs[i], points[i]["val_loss"]),
    )
    return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """A config's sections as one mapping of `section.key` to value."""
    return {
        f"{section}.{key}": value
        for section, values in config.items()
        if isinstance(values, dict)
        for key, value in values.items()
    }


def is_curve_key(key: str) -> bool:
    """Whether a `section.key` changes the curve of val loss against tokens."""
    section, _, name = key.partition(".")
    if key in NOT_CURVE_KEYS:
        return False
    return section in ("model", "data") or (section == "train" and name in TRAIN_CURVE_KEYS)


def curve_differences(run: dict[str, Any], reference: dict[str, Any]) -> dict[str, list[Any]]:
    """The curve keys whose values differ: `key -> [run's value, reference's value]`.

    Both configs are validated first, so a key either one leaves out takes its default.
    """
    ours, theirs = (flat_config(config_from_dict(c).to_dict()) for c in (run, reference))
    differs = {}
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key), theirs.get(key)
        if key in PATH_KEYS:
            a, b = (Path(v).name if isinstance(v, str) else v for v in (a, b))
        if is_curve_key(key) and a != b:
            differs[key] = [a, b]
    return differs


def config_name(run_dir: Path, meta: dict[str, Any]) -> tuple[str | None, str | None]:
    """The shipped config a run was trained from, and how that was found.

    `meta.json` records the config's name (a config file's stem); a run from before that was
    recorded is matched by its folder's name, which defaults to the config's.
    """
    shipped = shipped_configs()
    recorded = meta.get("config_name")
    if isinstance(recorded, str):
        return recorded, "meta.json" if recorded in shipped else None
    folder = run_dir.resolve().name
    return (folder, "the run folder's name") if folder in shipped else (None, None)


def check_run(
    run_dir: str | Path, config: dict[str, Any], meta: dict[str, Any] | None = None
) -> ReferenceCheck:
    """Place a run against its shipped config's reference curve.

    Args:
        run_dir: the run directory (its `meta.json` names the config, its `metrics.jsonl`
            holds the evaluations).
        config: the run's resolved config, as sections (`Config.to_dict()`).
        meta: its `meta.json` as `read_meta` gives it, if the caller has read it (None: read
            here), so that a damaged file is warned about once.

    Returns:
        The offset at the run's last evaluation (or at the reference's last point, if the run
        went on past it), and the differing curve keys; or `missing` saying why there is none.
    """
    run_dir = Path(run_dir)
    if meta is None:
        meta = read_meta(run_dir / META_FILE)
    name, matched_by = config_name(run_dir, meta)
    if matched_by is None:
        known = ", ".join(shipped_configs()) or "none"
        what = f"its config {name!r} is" if name else "it records no config name and its folder is"
        return ReferenceCheck(
            name, missing=f"{what} not a shipped config (shipped: {known}): no reference curve"
        )
    reference = load_reference(name)
    if reference is None or not reference.points:
        why = reference.note if reference is not None and reference.note else "none was measured"
        return ReferenceCheck(name, matched_by, missing=f"shipped config {name!r}: {why}")
    check = ReferenceCheck(
        name,
        matched_by,
        path=str(reference.path),
        measured=reference.measured,
        differs=curve_differences(config, reference.config),
        note=reference.note,
    )
    _place(check, eval_points(read_metrics(run_dir / METRICS_FILE)), reference.points)
    return check


def _place(check: ReferenceCheck, run: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    """Fill in the offset of the run's curve `run` from the reference's `ref`, or `missing`."""
    if not run:
        check.missing = "the run has no evaluation yet"
        return
    tokens = min(run[-1]["tokens"], ref[-1]["tokens"])
    ours, theirs = interpolate(run, tokens), interpolate(ref, tokens)
    if ours is None or theirs is None:
        check.missing = (
            f"the run's evaluations ({run[0]['tokens']:,} to {run[-1]['tokens']:,} tokens) do "
            f"not reach the reference's ({ref[0]['tokens']:,} to {ref[-1]['tokens']:,})"
        )
        return
    check.tokens, check.run_val_loss, check.reference_val_loss = tokens, ours, theirs
    check.offset = ours - theirs
    check.relative = check.offset / theirs


def reference_from_run(
    run_dir: str | Path, name: str, *, commit: str, date: str, note: str | None = None
) -> dict[str, Any]:
    """A reference file's content (JSON-ready) made from a finished run of the config `name`.

    The corpus paths are kept by file name (`data/<file>`), as a shipped config writes them.

    Args:
        run_dir: the measured run (its `config.yaml`, `meta.json` and `metrics.jsonl`).
        name: the shipped config it ran.
        commit: the llmcli commit that trained it.
        date: when it was measured (ISO date).
        note: anything a reader of the curve should know.

    Raises:
        InputError: `run_dir` has no evaluation with a finite val loss.
    """
    run_dir = Path(run_dir)
    config = load_config_file(run_dir).to_dict()
    for key in ("path", "val_path"):
        if isinstance(config["data"][key], str):
            config["data"][key] = f"data/{Path(config['data'][key]).name}"
    points = eval_points(read_metrics(run_dir / METRICS_FILE))
    if not points:
        raise InputError(f"'{run_dir}' has no evaluation with a val loss: train it first.")
    meta = read_meta(run_dir / META_FILE)
    measured = {
        "date": date,
        "commit": commit,
        "device": meta.get("device"),
        "dtype": meta.get("dtype"),
        "world_size": meta.get("world_size", 1),
        "seed": config["train"]["seed"],
        "steps": meta.get("step", points[-1]["step"]),
        "tokens": meta.get("tokens", points[-1]["tokens"]),
        "elapsed_s": meta.get("elapsed_s"),
        "versions": meta.get("versions"),
    }
    return {
        "format": FORMAT,
        "name": name,
        "note": note,
        "measured": measured,
        "points": points,
        "config": config,
    }


def describe(check: ReferenceCheck) -> list[tuple[str, str]]:
    """The check as (label, text) rows for a terminal: the reference, the offset, the keys."""
    if check.missing is not None:
        return [("reference", f"none: {check.missing}")]
    m = check.measured
    steps = f"{m['steps']:,}" if isinstance(m.get("steps"), int) else "?"
    rows = [
        (
            "reference",
            f"{check.name} ({steps} steps on {m.get('device')}, {m.get('dtype')}, seed "
            f"{m.get('seed')}, measured {m.get('date')} at {m.get('commit')}; matched by "
            f"{check.matched_by})",
        )
    ]
    assert check.offset is not None and check.relative is not None  # set where missing is not
    side = "above" if check.offset > 0 else "below" if check.offset < 0 else "level with"
    how_far = f"{abs(check.offset):.4f} ({abs(check.relative):.1%}) " if check.offset else ""
    rows.append(
        (
            "vs reference",
            f"val loss {check.run_val_loss:.4f} at {check.tokens:,} tokens, reference "
            f"{check.reference_val_loss:.4f}: {how_far}{side} it",
        )
    )
    if check.differs:
        keys = "; ".join(f"{k} {a} (reference {b})" for k, (a, b) in check.differs.items())
        rows.append(("curve keys differ", keys))
    else:
        rows.append(("curve keys differ", "none: same model, data, optimizer, schedule, batch"))
    return rows
