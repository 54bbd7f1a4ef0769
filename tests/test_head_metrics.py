"""Circuits during training, the parts beside the loop: the loss by position and the in-context
learning score (llmcli/training/evaluate.py), `head_metrics.jsonl` (llmcli/runs/head_metrics.py),
`train.head_metrics` in the config, `compare --metric induction_max`, and the tracker tags.
(The loop's records against a recomputation, and resume: tests/test_train.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import small_run_config

from llmcli.cli import main
from llmcli.config import config_from_dict
from llmcli.errors import ConfigError, InputError
from llmcli.evaluation.metrics import icl_score, icl_windows
from llmcli.model.gpt import Transformer
from llmcli.runs.compare import compare_runs
from llmcli.runs.head_metrics import cut_to_step, read_head_metrics
from llmcli.runs.metrics import JsonLinesLog, read_metrics
from llmcli.runs.trackers import tags
from llmcli.training.distributed import DistInfo
from llmcli.training.evaluate import evaluate_loss
from llmcli.training.loop import train
from llmcli.training.precision import Precision

pytestmark = pytest.mark.usefixtures("one_thread")


# --- the in-context learning score ------------------------------------------------------------


@pytest.mark.parametrize(
    ("context", "early", "late"),
    [
        (8, [0], [7]),
        (64, list(range(3, 10)), list(range(58, 64))),  # 5%..15% of 64, the last 6 (~10%)
        (256, list(range(13, 38)), list(range(230, 256))),
        (1, [0], [0]),
    ],
)
def test_icl_windows_scale_olsson_s_tokens_50_and_500_to_the_context(context, early, late) -> None:
    assert [list(w) for w in icl_windows(context)] == [early, late]


def test_icl_score_is_the_late_mean_minus_the_early_mean() -> None:
    by_position = [float(t) for t in np.linspace(3.0, 1.0, 64)]  # loss falls with context
    expected = np.mean(by_position[58:64]) - np.mean(by_position[3:10])
    assert icl_score(by_position) == pytest.approx(expected)
    assert icl_score(by_position) < 0


class _Batches:
    """A sampler that gives fixed batches in turn."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches, self.i = batches, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.i += 1
        return self.batches[self.i - 1]


def test_the_loss_by_position_is_each_position_s_mean_cross_entropy() -> None:
    config = config_from_dict(
        {"model": {"n_layer": 1, "n_head": 2, "n_embed": 8, "context_length": 6}}
    )
    model = Transformer(config.model, 11, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(11, (3, 6), generator=gen), torch.randint(11, (3, 6), generator=gen))
        for _ in range(2)
    ]
    precision = Precision.resolve(torch.device("cpu"), "float32")
    result = evaluate_loss(
        model, {"val": _Batches(batches)}, 2, precision, DistInfo(), by_position=True
    )
    # By hand, from the probabilities: -log p(target) at each (row, position), averaged.
    nll = []
    with torch.no_grad():
        for x, y in batches:
            p = torch.softmax(model(x)[0].double(), -1)
            nll.append(-torch.log(p.gather(-1, y[..., None])[..., 0]))  # (B, T)
    expected = torch.cat(nll).mean(0)
    np.testing.assert_allclose(result.by_position["val"], expected.numpy(), rtol=1e-5)
    assert result.mean["val"] == pytest.approx(expected.mean().item(), rel=1e-5)
    plain = evaluate_loss(model, {"val": _Batches(batches)}, 2, precision, DistInfo())
    assert plain.mean == result.mean and plain.by_position == {}


# --- head_metrics.jsonl -----------------------------------------------------------------------


def test_the_log_starts_afresh_or_cuts_back_to_its_size_at_the_save(tmp_path: Path) -> None:
    path = tmp_path / "head_metrics.jsonl"
    log = JsonLinesLog(path, keep_bytes=None)
    sizes = {}
    for step in (10, 20, 30):
        log.write({"step": step, "induction": [[step / 100]]})
        sizes[step] = log.size
    log.close()
    assert sizes[30] == path.stat().st_size
    with open(path, "ab") as f:
        f.write(b'{"step": 40, "indu')  # a crash mid-line
    assert [r["step"] for r in read_head_metrics(path)] == [10, 20, 30]

    log = JsonLinesLog(path, keep_bytes=sizes[20])  # records after the save are written again
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [10, 20]
    log.write({"step": 30, "induction": [[0.9]]})
    log.close()
    assert [(r["step"], r["induction"]) for r in read_head_metrics(path)] == [
        (10, [[0.1]]),
        (20, [[0.2]]),
        (30, [[0.9]]),
    ]
    JsonLinesLog(path, keep_bytes=None).close()  # a fresh start
    assert path.read_bytes() == b""


def test_a_state_without_the_size_cuts_the_log_to_the_step_it_resumes_from(tmp_path: Path) -> None:
    """Resume states written before the size was recorded: the records up to the save's step."""
    path = tmp_path / "head_metrics.jsonl"
    lines = [{"step": 10}, {"step": 20}, {"step": 30}]
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in lines) + b'{"step": 4')
    size = cut_to_step(path, 20)
    assert [json.loads(line) for line in path.read_text().splitlines()] == lines[:2]
    assert size == path.stat().st_size
    assert cut_to_step(tmp_path / "missing.jsonl", 20) == 0


def test_readers_keep_the_last_record_of_a_step(tmp_path: Path) -> None:
    path = tmp_path / "head_metrics.jsonl"
    lines = [{"step": 20, "v": 1}, {"step": 10, "v": 2}, {"step": 20, "v": 3}, ["not", "one"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert read_head_metrics(path) == [{"step": 10, "v": 2}, {"step": 20, "v": 3}]
    assert read_head_metrics(tmp_path / "missing.jsonl") == []


# --- the config key, compare and the trackers -------------------------------------------------


def test_head_metrics_must_be_a_boolean(tmp_path: Path, capsys) -> None:
    assert config_from_dict({}).train.head_metrics is True
    assert config_from_dict({"train": {"head_metrics": False}}).train.head_metrics is False
    with pytest.raises(ConfigError, match=r"train.head_metrics must be true or false, got 1"):
        config_from_dict({"train": {"head_metrics": 1}})
    with pytest.raises(SystemExit) as exc:
        main(["config", "tiny", "--set", "train.head_metrics=often"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "train.head_metrics must be true or false" in err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def two_runs(small_corpus: Path) -> Path:
    """Two runs, one with train.head_metrics and one without."""
    root = small_corpus.parent
    for on in (True, False):
        raw = small_run_config(
            small_corpus, max_steps=8, eval_interval=4, eval_steps=2, head_metrics=on
        )
        raw["model"]["n_layer"] = 2
        train(config_from_dict(raw), out_dir=root / f"heads-{on}", progress=False)
    return root


def test_compare_draws_the_head_metrics_and_names_a_run_without_them(two_runs: Path) -> None:
    on = two_runs / "heads-True"
    evals = [r for r in read_metrics(on / "metrics.jsonl") if r["kind"] == "eval"]
    grids = read_head_metrics(on / "head_metrics.jsonl")
    assert [r["step"] for r in evals] == [r["step"] for r in grids] == [4, 8]
    for record, grid in zip(evals, grids, strict=True):  # the summaries of the grids
        assert record["induction_max"] == pytest.approx(np.max(grid["induction"]))
        assert record["prev_token_max"] == pytest.approx(np.max(grid["prev_token"]))
        assert record["icl_score"] == grid["icl_score"]
    for metric in ("induction_max", "prev_token_max", "icl_score"):
        result = compare_runs([str(on), str(on)], metric=metric, out=two_runs / f"{metric}.png")
        assert result.picture is not None and result.picture.stat().st_size > 1000
    off = two_runs / "heads-False"
    with pytest.raises(InputError, match=r"'induction_max' .* of: .*heads-False \(it is logged"):
        compare_runs([str(on), str(off)], metric="induction_max")


def test_trackers_get_the_summaries_under_their_tags() -> None:
    record = {
        "kind": "eval",
        "step": 4,
        "val_loss": 2.5,
        "induction_max": 0.75,
        "prev_token_max": 0.5,
        "icl_score": -0.25,
    }
    assert tags(record) == {
        "eval/val_loss": 2.5,
        "heads/induction_max": 0.75,
        "heads/prev_token_max": 0.5,
        "eval/icl_score": -0.25,
    }
