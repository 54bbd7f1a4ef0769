"""Experiment trackers (llmcli/runs/trackers.py): TensorBoard and W&B get the records of
metrics.jsonl.

TensorBoard's event files are read back with its own `EventAccumulator`; the W&B run is the real
`wandb` package in offline mode (no network), its history read back from the run's `.wandb` log.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import math
from pathlib import Path

import pytest
import wandb
from conftest import small_run_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

import llmcli.runs.trackers
from llmcli.cli import main
from llmcli.config import config_from_dict
from llmcli.errors import InputError
from llmcli.runs.metrics import read_metrics
from llmcli.runs.trackers import TENSORBOARD_DIR, WANDB_ID_FILE, tags
from llmcli.training.loop import train

ROOT = Path(__file__).resolve().parents[1]
TIMED = {"train/tokens_per_s", "train/mfu", "progress/elapsed_s"}
# The tags docs/training.md ("Tracking runs") names, and the metrics.jsonl field each carries, by
# the kind of record: written out here, the reference the trackers are held to.
TAGS = {
    "train": {
        "train/loss": "train_loss",
        "train/lr": "lr",
        "train/grad_norm": "grad_norm",
        "train/tokens_per_s": "tok_per_s",
        "train/mfu": "mfu",
        "progress/tokens": "tokens",
        "progress/elapsed_s": "elapsed_s",
    },
    "eval": {
        "eval/train_loss": "train_loss",
        "eval/val_loss": "val_loss",
        "eval/val_ppl": "val_ppl",
        "eval/icl_score": "icl_score",
        "heads/induction_max": "induction_max",
        "heads/prev_token_max": "prev_token_max",
    },
}

pytestmark = pytest.mark.usefixtures("one_thread")


def raw_config(corpus: Path, **train_opts) -> dict:
    return small_run_config(
        corpus, **({"max_steps": 12, "eval_interval": 4, "eval_steps": 2} | train_opts)
    )


def expected_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] from metrics.jsonl's lines by the `TAGS` table, as the trackers
    must have them (these runs log no layers and have no spike-guard events)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert record["kind"] in TAGS and "layers" not in record, record
        for tag, key in TAGS[record["kind"]].items():
            if key in record:
                out.setdefault(tag, []).append((record["step"], float(record[key])))
    return out


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def assert_same_scalars(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for tag, points in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag  # once each, in order
        for (_, a), (_, b) in zip(got[tag], points, strict=True):
            assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6), tag  # TensorBoard: float32


def test_each_record_field_goes_under_its_documented_tag() -> None:
    train = {
        "kind": "train",
        "step": 6,
        "tokens": 384,
        "elapsed_s": 1.25,
        "lr": 3e-4,
        "train_loss": 2.5,
        "tok_per_s": 307.2,
        "mfu": 0.25,
        "grad_norm": 0.75,
        "layers": {
            "blocks.0": {"grad_norm": 0.5, "update_ratio": 0.002},
            "embed": {"grad_norm": 0.25, "update_ratio": 0.004},
        },
    }
    assert tags(train) == {
        "train/loss": 2.5,
        "train/lr": 3e-4,
        "train/grad_norm": 0.75,
        "train/tokens_per_s": 307.2,
        "train/mfu": 0.25,
        "progress/tokens": 384.0,
        "progress/elapsed_s": 1.25,
        "layers/blocks.0/grad_norm": 0.5,
        "layers/blocks.0/update_ratio": 0.002,
        "layers/embed/grad_norm": 0.25,
        "layers/embed/update_ratio": 0.004,
    }
    evaluation = {
        "kind": "eval",
        "step": 8,
        "tokens": 512,
        "elapsed_s": 2.0,
        "lr": 2e-4,
        "train_loss": 2.25,
        "val_loss": 2.375,
        "val_ppl": 10.75,
        "icl_score": -0.125,
        "induction_max": 0.625,
        "prev_token_max": 0.875,
    }
    # An evaluation's tokens, time and learning rate: the train records' tags carry those.
    assert tags(evaluation) == {
        "eval/train_loss": 2.25,
        "eval/val_loss": 2.375,
        "eval/val_ppl": 10.75,
        "eval/icl_score": -0.125,
        "heads/induction_max": 0.625,
        "heads/prev_token_max": 0.875,
    }
    # DPO's metrics keep TRL's names, under the record's group.
    dpo_train = {"kind": "train", "step": 3, "train_loss": 0.5, "rewards/margins": 0.25}
    assert tags(dpo_train) == {"train/loss": 0.5, "train/rewards/margins": 0.25}
    dpo_eval = {"kind": "eval", "step": 4, "val_loss": 0.625, "val_rewards/accuracies": 0.75}
    assert tags(dpo_eval) == {"eval/val_loss": 0.625, "eval/val_rewards/accuracies": 0.75}
    skipped = {"kind": "event", "event": "skipped", "step": 9, "loss": 7.5, "grad_norm": 40.0}
    assert tags(skipped) == {"guard/skipped_loss": 7.5}
    rollback = {"kind": "event", "event": "rollback", "step": 10, "loss": 8.5, "rollback": 2}
    assert tags(rollback) == {"guard/rollback_loss": 8.5, "guard/rollbacks": 2.0}


def test_tensorboard_holds_the_metrics_also_across_a_resume(small_corpus, tmp_path) -> None:
    config = config_from_dict(raw_config(small_corpus, logger="tensorboard"))
    reference = tmp_path / "reference"
    train(config, out_dir=reference, progress=False)
    want = expected_scalars(reference)
    assert {"train/loss", "train/grad_norm", "eval/val_loss", "progress/tokens"} <= set(want)
    assert_same_scalars(tensorboard_scalars(reference), want)

    run = tmp_path / "run"

    def crash(step: int) -> None:
        if step == 7:  # after the save of step 4 and the records of step 6
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError):
        train(config, out_dir=run, progress=False, on_step=crash)
    train(config, out_dir=run, resume=True, progress=False)
    # The resumed run rewrote the same records (times and speeds aside: they are measured).
    got = expected_scalars(run)
    assert {t: [s for s, _ in p] for t, p in got.items()} == {
        t: [s for s, _ in p] for t, p in want.items()
    }
    assert {t: p for t, p in got.items() if t not in TIMED} == {
        t: [(s, pytest.approx(v)) for s, v in p] for t, p in want.items() if t not in TIMED
    }
    assert_same_scalars(tensorboard_scalars(run), expected_scalars(run))
    # A fresh start in the same folder does not mix the earlier run's curves with its own.
    shorter = config_from_dict(raw_config(small_corpus, logger="tensorboard", max_steps=8))
    train(shorter, out_dir=run, overwrite=True, progress=False)
    assert max(s for s, _ in expected_scalars(run)["train/loss"]) == 8
    assert_same_scalars(tensorboard_scalars(run), expected_scalars(run))


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of the offline W&B run in `run_dir`, read from its `.wandb` log (a
    LevelDB-style log of protobuf `Record`s after a 7-byte header)."""
    # `run.finish()` can return before W&B's service process has written the whole log (1 run
    # in 12 here had only its header); teardown waits for the service, as a process exit does.
    wandb.teardown()
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, block = log.read_bytes(), 7, 32768
    assert data[:4] == b":W&B"
    chunks, pending = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block  # a block's tail too short for a header is padding
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL, or LAST of a split record
            chunks.append(pending + chunk)
            pending = b""
        elif kind in (2, 3):  # FIRST or MIDDLE
            pending += chunk
    rows = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
    return rows


def test_wandb_offline_logs_the_metrics_and_resumes_the_same_run(
    small_corpus, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    config = config_from_dict(raw_config(small_corpus, logger="wandb", wandb_project="tests"))
    run = tmp_path / "run"
    train(config, out_dir=run, progress=False)
    run_id = (run / WANDB_ID_FILE).read_text().strip()
    rows = wandb_history(run)
    want = expected_scalars(run)
    for tag, points in want.items():
        got = [(r["_step"], r[tag]) for r in rows if tag in r]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in points]), tag
    more = config_from_dict(raw_config(small_corpus, logger="wandb", max_steps=16))
    train(more, out_dir=run, resume=True, progress=False)
    assert (run / WANDB_ID_FILE).read_text().strip() == run_id  # the same W&B run continues
    assert len(list(run.glob(f"wandb/offline-run-*-{run_id}"))) == 2  # one folder per start
    train(config, out_dir=run, overwrite=True, progress=False)
    assert (run / WANDB_ID_FILE).read_text().strip() != run_id  # a fresh start: a new W&B run


def test_wandb_that_cannot_start_is_bad_input(small_corpus, tmp_path, monkeypatch) -> None:
    def no_key(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_key)
    config = config_from_dict(raw_config(small_corpus, logger="wandb"))
    with pytest.raises(InputError, match=r"W&B could not start a run: No API key.*WANDB_MODE") as e:
        train(config, out_dir=tmp_path / "run", progress=False)
    assert "to log in. Log in" in str(e.value) and ".." not in str(e.value)  # one period


def test_a_failing_tracker_warns_once_and_training_goes_on(
    small_corpus, tmp_path, monkeypatch, caplog
) -> None:
    def full_disk(self, record) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(llmcli.runs.trackers.TensorBoardTracker, "log", full_disk)
    config = config_from_dict(raw_config(small_corpus, logger="tensorboard"))
    with caplog.at_level(logging.WARNING, logger="llmcli.runs.trackers"):
        summary = train(config, out_dir=tmp_path / "run", progress=False)
    assert summary.step == 12
    warnings = [r for r in caplog.records if "tensorboard logging failed" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 9  # 6 train + 3 eval


def test_a_missing_package_or_unknown_tracker_exits_2_before_training(
    small_corpus, tmp_path, monkeypatch, capsys
) -> None:
    config_file = tmp_path / "c.yaml"
    config_file.write_text(json.dumps(raw_config(small_corpus)))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    for value, message in (
        ("wandb", "pip install 'llmcli[wandb]'"),
        ("mlflow", "'mlflow' is not a tracker; the choices are none, tensorboard, wandb"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(
                [
                    "train",
                    str(config_file),
                    "--out",
                    str(tmp_path / "run"),
                    "--set",
                    f"train.logger={value}",
                ]
            )
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err and "Traceback" not in err
        assert not (tmp_path / "run").exists()  # nothing started


def test_the_gradient_norm_is_logged_with_and_without_clipping(small_corpus, tmp_path) -> None:
    norms = {}
    for clip in (1.0, 0.0):
        config = config_from_dict(raw_config(small_corpus, grad_clip=clip, log_interval=1))
        train(config, out_dir=tmp_path / f"clip-{clip}", progress=False)
        norms[clip] = [
            r["grad_norm"]
            for r in read_metrics(tmp_path / f"clip-{clip}" / "metrics.jsonl")
            if r["kind"] == "train"
        ]
        assert len(norms[clip]) == 12 and all(math.isfinite(n) and n > 0 for n in norms[clip])
    # Step 1 starts from the same weights: clipping's norm and the unclipped measure agree.
    assert norms[1.0][0] == norms[0.0][0]
    assert norms[1.0][1:] != norms[0.0][1:]  # after it, clipping changed the updates
