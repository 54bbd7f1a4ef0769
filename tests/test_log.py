"""What the training loop reads and logs (llmcli/training/log.py): the run's files at the start,
its logs cut back to the save it resumes from, the layer watch of log steps, the losses read at
once. (The records a whole run writes: tests/test_train.py, tests/test_head_metrics.py.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import small_run_config

from llmcli.config import config_from_dict
from llmcli.runs.directory import CONFIG_FILE, HEAD_METRICS_FILE, METRICS_FILE, TOKENIZER_FILE
from llmcli.training.build import started
from llmcli.training.distributed import DistInfo
from llmcli.training.log import LossLog, TrainLog

pytestmark = pytest.mark.usefixtures("one_thread")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def run(small_corpus, tmp_path):
    raw = small_run_config(small_corpus, max_steps=20, head_metrics=True, log_layers=True)
    with started(config_from_dict(raw), tmp_path / "run", False, False) as built:
        yield built


def write_logs(run_dir: Path) -> tuple[int, int]:
    """Three records in each log; the sizes after the first two."""
    metrics = [json.dumps({"kind": "train", "step": s}) + "\n" for s in (5, 10, 15)]
    heads = [json.dumps({"step": s}) + "\n" for s in (5, 10, 15)]
    (run_dir / METRICS_FILE).write_text("".join(metrics))
    (run_dir / HEAD_METRICS_FILE).write_text("".join(heads))
    return len("".join(metrics[:2])), len("".join(heads[:2]))


def test_a_fresh_start_writes_the_run_files_and_empties_the_logs(run) -> None:
    run_dir = run.facts.run_dir
    write_logs(run_dir)
    with TrainLog.open(run.config, run.data, run.facts, main=True):
        pass
    assert (run_dir / CONFIG_FILE).is_file() and (run_dir / TOKENIZER_FILE).is_file()
    assert (
        (run_dir / METRICS_FILE).read_bytes() == (run_dir / HEAD_METRICS_FILE).read_bytes() == b""
    )


def test_a_resumed_run_cuts_each_log_to_its_size_at_the_save(run) -> None:
    run_dir = run.facts.run_dir
    metrics_bytes, heads_bytes = write_logs(run_dir)
    facts = dataclasses.replace(
        run.facts, resumed_from=10, metrics_bytes=metrics_bytes, head_metrics_bytes=heads_bytes
    )
    with TrainLog.open(run.config, run.data, facts, main=True) as log:
        assert log.sizes() == (metrics_bytes, heads_bytes)
    assert [r["step"] for r in lines(run_dir / METRICS_FILE)] == [5, 10]
    assert [r["step"] for r in lines(run_dir / HEAD_METRICS_FILE)] == [5, 10]


def test_a_log_one_byte_longer_than_at_the_save_is_cut_back_to_it(run) -> None:
    """A run killed just after a save may have written one byte of the next record."""
    run_dir = run.facts.run_dir
    sizes = write_logs(run_dir)
    for name, size in zip((METRICS_FILE, HEAD_METRICS_FILE), sizes, strict=True):
        path = run_dir / name
        path.write_bytes(path.read_bytes()[: size + 1])
    facts = dataclasses.replace(
        run.facts, resumed_from=10, metrics_bytes=sizes[0], head_metrics_bytes=sizes[1]
    )
    with TrainLog.open(run.config, run.data, facts, main=True) as log:
        assert log.sizes() == sizes
    assert [r["step"] for r in lines(run_dir / METRICS_FILE)] == [5, 10]
    assert [r["step"] for r in lines(run_dir / HEAD_METRICS_FILE)] == [5, 10]


def test_a_state_that_did_not_record_the_head_log_cuts_it_at_its_step(run) -> None:
    run_dir = run.facts.run_dir
    metrics_bytes, _ = write_logs(run_dir)
    facts = dataclasses.replace(
        run.facts, resumed_from=5, metrics_bytes=metrics_bytes, head_metrics_bytes=None
    )
    with TrainLog.open(run.config, run.data, facts, main=True):
        pass
    assert [r["step"] for r in lines(run_dir / HEAD_METRICS_FILE)] == [5]


def test_other_ranks_write_nothing(run) -> None:
    run_dir = run.facts.run_dir
    with TrainLog.open(run.config, run.data, run.facts, main=False) as log:
        log.train_step(run.state, 1e-3, 2.0, 10.0, torch.tensor(1.0), None)
        assert log.sizes() == (0, None) and log.layer_watch(run.model, log_step=True) is None
    assert not (run_dir / CONFIG_FILE).exists() and not (run_dir / METRICS_FILE).exists()


def test_the_layer_watch_measures_log_steps_only_with_log_layers(run) -> None:
    with TrainLog.open(run.config, run.data, run.facts, main=True) as log:
        assert log.layer_watch(run.model, log_step=False) is None
        watch = log.layer_watch(run.model, log_step=True)
        assert watch is not None and set(watch.groups) == {"embed", "blocks.0", "final"}
    config = dataclasses.replace(
        run.config, train=dataclasses.replace(run.config.train, log_layers=False)
    )
    with TrainLog.open(config, run.data, run.facts, main=True) as log:
        assert log.layer_watch(run.model, log_step=True) is None


def test_the_losses_stay_on_the_device_until_one_read() -> None:
    losses = LossLog()
    for value in (2.0, 1.5, 1.25):
        losses.add(torch.tensor(value))
    assert losses.read(DistInfo()) == [2.0, 1.5, 1.25] and losses.pending == []
    losses.add(torch.tensor(1.0))
    losses.clear()
    losses.add(torch.tensor(0.5))
    assert losses.read(DistInfo()) == [0.5]


def test_a_log_step_reads_its_own_steps_metrics_and_a_rollback_forgets_them() -> None:
    losses = LossLog()
    losses.add(torch.tensor(2.0), {"rewards/margins": torch.tensor(0.25)})
    losses.add(
        torch.tensor(1.5),
        {"rewards/margins": torch.tensor(0.5), "logps/chosen": torch.tensor(-3.0)},
    )
    assert losses.read_metrics(DistInfo()) == {"logps/chosen": -3.0, "rewards/margins": 0.5}
    losses.clear()  # the steps a rollback undoes
    assert losses.read_metrics(DistInfo()) == {}
    losses.add(torch.tensor(1.0))  # next-token training: no metrics
    assert losses.read_metrics(DistInfo()) == {}
