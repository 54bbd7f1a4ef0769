"""The resume state (llmcli/training/state.py): what `state.pt` holds, and its checks on reading.

The loop's own tests (test_train.py, test_crash.py) prove that a resume is exact; these pin the
file's layout (the keys and types every llmcli so far has written) and the checks that refuse a
damaged state with a message naming the file, before any of it is used.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from conftest import small_run_config

from llmcli.cli import main
from llmcli.errors import CheckpointError
from llmcli.runs.directory import STATE_FILE
from llmcli.runs.formats import WEIGHTS_FORMAT, load_state, save_state
from llmcli.training.counters import TrainState
from llmcli.training.rng import rng_state
from llmcli.training.state import ResumeState

# The keys of `state.pt`, in the order llmcli writes them (those before "head_metrics_bytes" in
# the order every llmcli so far has written them).
KEYS = [
    "format",
    "step",
    "tokens",
    "elapsed_s",
    "best_val_loss",
    "best_step",
    "last_eval",
    "metrics_bytes",
    "vocab_size",
    "source_hash",
    "config",
    "model",
    "optimizer",
    "scaler",
    "rng",
    "sampler",
    "guard",
    "head_metrics_bytes",
    "eval_pending",
]


def make_state() -> ResumeState:
    counters = TrainState(
        step=20,
        tokens=640,
        elapsed_base=3.5,
        best_val_loss=1.25,
        best_step=10,
        last_eval={"train": 1.5, "val": 1.25},
        eval_pending=True,
    )
    return ResumeState(
        counters=counters,
        metrics_bytes=1234,
        head_metrics_bytes=567,
        vocab_size=65,
        source_hash="ab" * 32,
        config={"model": {"n_layer": 1}, "train": {"optimizer": "adamw"}},
        model={"w": torch.arange(6.0).reshape(2, 3)},
        optimizer={"state": {}, "param_groups": [{"lr": 1e-3, "params": [0]}]},
        scaler={},
        rng=[rng_state(torch.device("cpu"))] * 2,
        sampler=[{"rng_state": torch.Generator().get_state(), "batches": 20}] * 2,
    )


def test_the_file_holds_the_keys_earlier_versions_wrote_and_reads_back(tmp_path: Path) -> None:
    state = make_state()
    save_state(tmp_path / STATE_FILE, state.to_dict())
    saved = load_state(tmp_path / STATE_FILE)
    assert list(saved) == KEYS and saved["format"] == WEIGHTS_FORMAT
    assert saved["elapsed_s"] >= 3.5 and isinstance(saved["elapsed_s"], float)
    back = ResumeState.load(tmp_path)
    c = back.counters
    assert (c.step, c.tokens, c.best_val_loss, c.best_step) == (20, 640, 1.25, 10)
    assert c.last_eval == {"train": 1.5, "val": 1.25} and c.elapsed_base == saved["elapsed_s"]
    assert c.last_saved == 20  # the save a run resumes from is its latest
    assert c.eval_pending is True
    assert torch.equal(back.model["w"], state.model["w"])
    assert (back.metrics_bytes, back.vocab_size, back.source_hash) == (1234, 65, "ab" * 32)
    assert back.head_metrics_bytes == 567
    assert (back.config, back.optimizer, back.scaler) == (state.config, state.optimizer, {})
    assert [s["batches"] for s in back.sampler] == [20, 20] and len(back.rng) == 2
    assert all(torch.equal(s["rng_state"], state.sampler[0]["rng_state"]) for s in back.sampler)


def test_keys_a_state_may_lack_take_their_defaults(tmp_path: Path) -> None:
    saved = make_state().to_dict()
    optional = ("best_val_loss", "best_step", "last_eval", "vocab_size", "source_hash", "scaler")
    for key in (*optional, "guard", "head_metrics_bytes"):
        del saved[key]
    state = ResumeState.from_dict(saved, tmp_path / STATE_FILE)
    assert state.counters.best_val_loss == math.inf and state.counters.best_step is None
    assert state.counters.last_eval == {} and state.scaler == {}
    assert state.vocab_size is None and state.source_hash is None and state.guard is None
    assert state.head_metrics_bytes is None


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("step", None),  # a key every state holds, missing
        ("model", [1, 2]),
        ("elapsed_s", "3 s"),
        ("last_eval", "1.5"),  # a key a state may lack, present with the wrong type
        ("best_val_loss", "low"),
        ("scaler", [0]),
        ("guard", [0.5]),
        ("step", True),  # a bool is no step count
        ("step", -5),
        ("metrics_bytes", -1),
        ("head_metrics_bytes", -1),
        ("head_metrics_bytes", "12"),
        ("config", {"model": {"n_layer": 1}, "train": []}),
        ("optimizer", {"param_groups": []}),
        ("rng", [{"torch": torch.zeros(4, dtype=torch.uint8)}] * 2),  # NumPy's, Python's missing
    ],
)
def test_a_malformed_state_is_refused_naming_the_file_and_the_key(
    tmp_path: Path, key: str, value: object
) -> None:
    saved = make_state().to_dict()
    if value is None:
        del saved[key]
    else:
        saved[key] = value
    with pytest.raises(CheckpointError, match=f"incomplete or malformed .*: {key}\\)") as info:
        ResumeState.from_dict(saved, tmp_path / STATE_FILE)
    assert str(tmp_path / STATE_FILE) in str(info.value)


@pytest.mark.parametrize(
    ("rng", "sampler"),
    [([], []), ([{}], [{}, {}]), ([{}, "x"], [{}, {}])],
    ids=["no-rank", "ranks-differ", "not-a-dict"],
)
def test_rng_and_sampler_states_must_pair_up_by_rank(tmp_path: Path, rng, sampler) -> None:
    saved = {**make_state().to_dict(), "rng": rng, "sampler": sampler}
    with pytest.raises(CheckpointError, match="missing or wrong: rng, sampler"):
        ResumeState.from_dict(saved, tmp_path / STATE_FILE)


def rename_a_weight(state: dict) -> None:
    state["model"]["blockr.0.attn.qkv.weight"] = state["model"].pop("blocks.0.attn.qkv.weight")


def shrink_a_weight(state: dict) -> None:
    state["model"]["wte.weight"] = state["model"]["wte.weight"][:-1]


def drop_a_param_group(state: dict) -> None:
    state["optimizer"]["param_groups"].pop()


def empty_the_sampler(state: dict) -> None:
    state["sampler"] = [{}]


def damage_the_torch_rng(state: dict) -> None:
    state["rng"][0]["torch"] = state["rng"][0]["torch"][:10]


@pytest.mark.slow  # trains a run to damage its save
@pytest.mark.parametrize(
    "damage",
    [rename_a_weight, shrink_a_weight, drop_a_param_group, empty_the_sampler, damage_the_torch_rng],
)
def test_a_state_that_loads_but_does_not_fit_is_refused_with_exit_2(
    small_corpus: Path, tmp_path: Path, damage, capsys
) -> None:
    import json

    from conftest import small_run_config

    from llmcli.cli import main

    config = tmp_path / "c.json"
    config.write_text(json.dumps(small_run_config(small_corpus, max_steps=4, eval_interval=4)))
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(config), "--out", str(run), "--no-progress"])
    assert exit_info.value.code == 0
    state = torch.load(run / STATE_FILE, weights_only=True)
    damage(state)
    torch.save(state, run / STATE_FILE)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(config), "--out", str(run), "--resume", "--set", "train.max_steps=6"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert str(run / STATE_FILE) in err and "Traceback" not in err


def _train(capsys, config: Path, out: Path, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(config), "--out", str(out), "--no-progress", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 0, err
    return err


def test_a_resume_with_other_settings_says_what_they_change_and_how_to_keep_the_saved_ones(
    small_corpus, tmp_path, capsys
) -> None:
    config = tmp_path / "run.yaml"
    raw = small_run_config(small_corpus, max_steps=6, eval_interval=3, eval_steps=1)
    config.write_text(yaml.safe_dump(raw))
    run = tmp_path / "run"
    _train(capsys, config, run, "--set", "train.max_steps=3", "--set", "train.lr=0.002")
    # The first command's --set left out: the config's values apply, and the resume says so.
    err = " ".join(_train(capsys, config, run, "--resume").split())
    assert (
        "resuming with settings that differ from the saved run's: train.max_steps 3 -> 6 (where "
        "the run ends, and the learning-rate schedule stretched to it); train.lr 0.002 -> 0.001 "
        "(the learning rate from here on). The command's settings apply from here on" in err
    )
    assert "resume with --set train.max_steps=3 --set train.lr=0.002." in err
    assert json.loads((run / "meta.json").read_text())["step"] == 6
    # The same settings as the saved run's: nothing to say.
    err = _train(capsys, config, run, "--resume", "--set", "train.max_steps=8")
    assert "train.max_steps 6 -> 8" in err and "train.lr" not in err
    err = _train(capsys, config, run, "--resume", "--set", "train.max_steps=8")
    assert "differ from the saved run's" not in err


def test_a_resumed_automatic_batch_is_no_changed_setting(small_corpus, tmp_path, capsys) -> None:
    config = tmp_path / "run.yaml"
    raw = small_run_config(small_corpus, max_steps=4, eval_interval=2, eval_steps=1)
    raw["train"].update(batch_size="auto", tokens_per_step=4 * 16, memory_limit="1GiB")
    config.write_text(yaml.safe_dump(raw))
    run = tmp_path / "run"
    _train(capsys, config, run, "--set", "train.max_steps=2")
    saved = yaml.safe_load((run / "config.yaml").read_text())["train"]
    assert isinstance(saved["batch_size"], int)  # the run resolved it
    # Resolved again as the saved run's numbers: only max_steps differs.
    err = " ".join(_train(capsys, config, run, "--resume").split())
    differ = err[err.index("settings that differ") : err.index("The command's settings apply")]
    assert "train.max_steps 2 -> 4" in differ
    assert "train.batch_size" not in differ and "train.grad_accum" not in differ
