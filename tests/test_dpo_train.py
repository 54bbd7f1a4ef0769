"""DPO training (`train.objective: dpo`, llmcli/training/build.py, step.py's `loss_fn`,
dpo.py's `dpo_objective` and `reference_model`): a tiny chat run fine-tuned on preference pairs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from chat_helpers import CHARS, save_chat_run
from conftest import save_tiny_run

from llmcli.cli import main
from llmcli.config import Config, config_from_dict, dump_yaml
from llmcli.data.chat_template import default_template
from llmcli.data.preference_data import PreferenceSampler, pair_batch, preference_token_data
from llmcli.data.tokenizer import CharTokenizer
from llmcli.model.gpt import Transformer
from llmcli.objectives.dpo import dpo_step, score_pairs_once
from llmcli.objectives.dpo_losses import DPOLoss
from llmcli.objectives.preference_scores import completion_logps
from llmcli.runs.formats import load_weights, read_weights
from llmcli.runs.info import format_info, run_info
from llmcli.runs.loading import load_run, load_tokenizer_file
from llmcli.runs.metrics import read_metrics
from llmcli.training import build
from llmcli.training.evaluate import EVAL_SEED_OFFSET
from llmcli.training.init_from import load_init_weights, resolve_init_from
from llmcli.training.loop import train
from llmcli.training.plan import format_plan, make_plan

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def pair(i: int) -> dict:
    a, b = LETTERS[i % 26], LETTERS[(3 * i + 1) % 26]
    return {
        "prompt": [{"role": "user", "content": f"spell {a}{b}"}],
        "chosen": [{"role": "assistant", "content": f"{a}-{b}"}],
        "rejected": [{"role": "assistant", "content": "no idea"}],
    }


def write_pairs(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dpo_config(base: Path, folder: Path, **train: object) -> Config:
    raw = {
        "model": {"dropout": 0.0},
        "data": {
            "format": "preference",
            "path": str(write_pairs(folder / "train.jsonl", [pair(i) for i in range(12)])),
            "val_path": str(write_pairs(folder / "val.jsonl", [pair(i) for i in range(12, 16)])),
        },
        "train": {
            "objective": "dpo",
            "dpo_beta": 0.5,
            "init_from": str(base),
            "device": "cpu",
            "batch_size": 4,
            "max_steps": 8,
            "warmup_steps": 1,
            "lr": 3e-3,
            "min_lr": 3e-3,
            "eval_interval": 4,
            "eval_steps": 1,
            "log_interval": 1,
            "seed": 5,
            **train,
        },
    }
    return config_from_dict(raw, name="dpo")


def test_dpo_run_starts_at_log_2_learns_the_pairs_and_never_moves_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    base = save_chat_run(tmp_path / "base", n_layer=1, n_embed=16, context_length=32)
    config = dpo_config(base, tmp_path)
    references: list[Transformer] = []
    made = build.reference_model

    def kept_reference(*args, **kwargs) -> Transformer:  # the run's reference, kept to check
        references.append(made(*args, **kwargs))
        return references[-1]

    monkeypatch.setattr(build, "reference_model", kept_reference)
    with caplog.at_level("INFO"):
        train(config, out_dir=tmp_path / "dpo", progress=False)
    # The evaluation's line says what its reward accuracy is over, and has no induction head
    # (a preference loss says nothing of them); `llmcli info` shows DPO's figures at the best.
    evals = [r.getMessage() for r in caplog.records if "val loss" in r.getMessage()]
    assert evals and all("strongest induction head" not in line for line in evals), evals
    assert re.search(
        r"val reward accuracy [\d.]+, margin -?[\d.]+ "
        r"\(on 4 pairs drawn from the \d+ validation pairs\)",
        evals[-1],
    ), evals[-1]
    shown = format_info(run_info(tmp_path / "dpo"))
    assert re.search(r"best evaluation +val rewards/accuracies [\d.]+%, val rewards/margins", shown)

    # Step 1's batch by hand: the training stream's first draw, scored by the initial weights
    # as both policy and reference (the same model: every log-ratio is 0, the loss log 2).
    resolved = resolve_init_from(config)
    tokenizer = load_tokenizer_file(base)
    data = preference_token_data(resolved.data, 32, tokenizer, default_template())
    assert data.preference is not None
    sampler = PreferenceSampler(data.preference.train, data.preference.pad_id, 4, 32, seed=5)
    ids, mask = sampler.next()
    initial = Transformer(resolved.model, tokenizer.vocab_size)
    load_init_weights(initial, str(base))
    initial.eval()
    with torch.no_grad():
        by_hand, metrics = dpo_step(initial, initial, ids, mask, DPOLoss(0.5))
    assert by_hand.item() == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["rewards/margins"].item() == 0.0

    all_records = read_metrics(tmp_path / "dpo" / "metrics.jsonl")
    records = [r for r in all_records if r["kind"] == "train"]
    losses = [r["train_loss"] for r in records]
    assert len(losses) == 8
    assert losses[0] == pytest.approx(by_hand.item(), abs=1e-5)
    assert max(losses[-3:]) < losses[0] - 0.05  # the policy learns to prefer the chosen replies
    # Each log step records its step's metrics under TRL's names. (Step 1's rewards are 0 up to
    # the last bits of the reference's scores, computed once in other batches: which of each
    # pair's two is higher, the accuracy, is those bits' to decide.)
    for name, value in metrics.items():
        if name != "rewards/accuracies":
            assert records[0][name] == pytest.approx(value.item(), abs=1e-5), name
    assert records[-1]["rewards/accuracies"] > 0.5 and records[-1]["rewards/margins"] > 0
    # The log's tokens are those the model read: each row up to its last token (the
    # completion's end, which is only a target), none of the padding after it.
    draws = PreferenceSampler(data.preference.train, data.preference.pad_id, 4, 32, seed=5)
    read = 0
    for record in records:
        _, drawn = draws.next()  # (2B, L): True on each completion, which ends its row
        ends = drawn.shape[1] - drawn.flip(1).int().argmax(dim=1)  # one past each row's end
        read += int((ends - 1).sum())
        assert record["tokens"] == read, (record["step"], record["tokens"], read)
    assert read < 8 * 4 * 2 * 32  # padded to the context, a step would count 2 x 4 x 32

    # The last evaluation by hand: the final weights against the reference on the validation
    # pairs the evaluation sampler draws (its own seed), TRL's metrics under "val_".
    (last_eval,) = [r for r in all_records if r["kind"] == "eval" and r["step"] == 8]
    final = Transformer(resolved.model, tokenizer.vocab_size)
    weights = tmp_path / "dpo" / "model.safetensors"
    load_weights(final, read_weights(weights)[0], weights)
    final.eval()
    val = PreferenceSampler(
        data.preference.val, data.preference.pad_id, 4, 32, 5 + EVAL_SEED_OFFSET
    )
    with torch.no_grad():
        val_loss, val_metrics = dpo_step(final, initial, *val.next(), DPOLoss(0.5))
    assert last_eval["val_loss"] == pytest.approx(val_loss.item(), abs=1e-5)
    for name, value in val_metrics.items():
        assert last_eval[f"val_{name}"] == pytest.approx(value.item(), abs=1e-5), name
    assert "val_ppl" not in last_eval  # a DPO loss is no perplexity

    (reference,) = references
    assert not reference.training
    assert not any(p.requires_grad for p in reference.parameters())
    for name, tensor in initial.state_dict().items():
        torch.testing.assert_close(reference.state_dict()[name], tensor, rtol=0, atol=0)


def test_a_dpo_plan_counts_two_rows_a_pair_and_the_reference(tmp_path: Path) -> None:
    base = save_chat_run(tmp_path / "base", n_layer=2, n_embed=16, context_length=32)
    config = dpo_config(base, tmp_path, grad_accum=3, memory_limit="1GiB")
    plan = make_plan(config, "cpu", measure_s=1.0)
    vocab = load_tokenizer_file(base).vocab_size
    n = Transformer(resolve_init_from(config).model, vocab).num_parameters(non_embedding=False)
    B, L, T, C = 4, 2, 32, 16
    got = plan.to_json()
    assert plan.vocab_size == vocab and plan.missing is None
    assert got["tokens_per_step"] == B * 2 * T * 3  # pairs x their two rows x grad_accum
    # llmcli/training/memory.py's formula for next-token training, on 2B rows, plus the
    # reference's logits per token and its fp32 weights.
    activations = 2 * B * T * 4 * (L * 20 * C + 4 * C + 4 * vocab + vocab)
    assert got["memory"]["activations"] == activations
    assert got["memory"]["reference"] == 4 * n
    assert got["memory"]["peak"] == 16 * n + 4 * n + activations + 80 * 2**20
    assert plan.timing is not None and plan.timing.steps >= 1
    assert "4 pairs (2 rows each) x 64 tokens x grad_accum 3" in format_plan(plan)


def test_a_resumed_dpo_run_is_bitwise_the_uninterrupted_one(tmp_path: Path, ctrl_c_raises) -> None:
    base = save_chat_run(tmp_path / "base", n_layer=1, n_embed=16, context_length=32)
    # Dropout on: the resumed run must also draw the masks the uninterrupted one drew.
    config = dpo_config(base, tmp_path, max_steps=10, eval_interval=5, grad_accum=2)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, dropout=0.1))
    straight = tmp_path / "straight"
    train(config, out_dir=straight, progress=False)

    def interrupt(step: int) -> None:
        if step == 5:  # a Ctrl-C at an evaluation step: it runs when the run resumes
            signal.raise_signal(signal.SIGINT)

    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        train(config, out_dir=resumed, progress=False, on_step=interrupt)
    summary = train(config, out_dir=resumed, resume=True, progress=False)
    assert summary.resumed_from == 5 and summary.step == 10
    a, b = (read_weights(run / "model.safetensors")[0] for run in (straight, resumed))
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs bitwise"
    records = [read_metrics(run / "metrics.jsonl") for run in (straight, resumed)]
    drop = ("elapsed_s", "tok_per_s", "mfu")
    assert [{k: v for k, v in r.items() if k not in drop} for r in records[0]] == [
        {k: v for k, v in r.items() if k not in drop} for r in records[1]
    ]

    # meta.json and `llmcli info` say how the pairs fit and what the run is scored against.
    run = load_run(resumed)
    counts = {"pairs": 4, "kept": 4, "truncated": 0, "skipped": 0}
    assert run.meta["preference_data"] == {
        "train": {**counts, "pairs": 12, "kept": 12},
        "val": counts,
    }
    info = run_info(resumed)
    assert info["preference"] == {
        "beta": 0.5,
        "loss_type": None,  # sigmoid
        "loss_weights": None,
        "reference": str(base.resolve()),
        "data": run.meta["preference_data"],
    }
    row = f"dpo +beta 0.5 against {re.escape(str(base.resolve()))}; 12 training pairs: 12 kept"
    assert re.search(row, format_info(info))


@pytest.mark.slow
def test_ddp_dpo_on_two_processes_is_one_process_on_the_union_of_their_pairs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import llmcli.objectives.dpo

    base = save_chat_run(tmp_path / "base", n_layer=1, n_embed=16, context_length=32)
    steps = dict(max_steps=6, eval_interval=3, log_interval=3, batch_size=2)
    config_file = tmp_path / "ddp.yaml"
    config_file.write_text(dump_yaml(dpo_config(base, tmp_path, **steps)))
    ddp_dir = tmp_path / "ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    out = subprocess.run(
        [
            *command,
            "-m",
            "llmcli",
            "train",
            str(config_file),
            "--out",
            str(ddp_dir),
            "--no-progress",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]

    # One process, 4 pairs a batch: rank 0's 2 pairs then rank 1's, chosen rows then rejected.
    Sampler = PreferenceSampler

    class Union:
        def __init__(self, pairs, pad_id, batch_size, context_length, seed, rank, world, device):
            self.parts = [
                Sampler(pairs, pad_id, batch_size // 2, context_length, seed, r, 2, device)
                for r in range(2)
            ]

        def next(self):  # each part's rows: ids, masks and the reference's scores
            parts = [part.next() for part in self.parts]
            half = len(parts[0][0]) // 2
            return tuple(
                torch.cat([a[:half], b[:half], a[half:], b[half:]])
                for a, b in zip(*parts, strict=True)
            )

        @property
        def tokens_drawn(self):
            return sum(part.tokens_drawn for part in self.parts)

        def state_dict(self):
            return {"parts": [part.state_dict() for part in self.parts]}

    monkeypatch.setattr(llmcli.objectives.dpo, "PreferenceSampler", Union)
    one_dir = tmp_path / "one"
    train(dpo_config(base, tmp_path, **{**steps, "batch_size": 4}), out_dir=one_dir, progress=False)

    ddp, one = (read_metrics(run / "metrics.jsonl") for run in (ddp_dir, one_dir))
    assert [(r["kind"], r["step"], r["tokens"]) for r in ddp] == [
        (r["kind"], r["step"], r["tokens"]) for r in one
    ]
    for a, b in zip(ddp, one, strict=True):  # the losses and DPO's metrics, averaged over ranks
        for name in (
            "train_loss",
            "grad_norm",
            "val_loss",
            "rewards/margins",
            "val_rewards/margins",
        ):
            if name in b:
                assert a[name] == pytest.approx(b[name], abs=1e-5), (b["step"], name)
    # (AdamW's update divides by the gradients' size: where they are near 0, the order the
    # ranks' sums were added in shows in the weights' last digits.)
    a, b = (read_weights(run / "model.safetensors")[0] for run in (ddp_dir, one_dir))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-4)


def _train_cli(capsys, *args: object) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(["train", *map(str, args), "--no-progress"])
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "spell ab", "chosen": "a-b"}, "line 3: a row must be an object with"),
        ({"prompt": "spell ab", "chosen": "a-b", "rejected": "a-b"}, "line 3: 'chosen' and "),
        ({"prompt": 5, "chosen": "a-b", "rejected": "no"}, "line 3: 'prompt' must be text or"),
    ],
)
def test_a_bad_row_exits_2_naming_its_line_and_writes_nothing(
    tmp_path: Path, capsys, row: dict, message: str
) -> None:
    base = save_chat_run(tmp_path / "base", n_layer=1, n_embed=16, context_length=32)
    config = dpo_config(base, tmp_path)
    write_pairs(Path(config.data.path), [pair(0), pair(1), row, pair(2)])
    config_file = tmp_path / "dpo.yaml"
    config_file.write_text(dump_yaml(config))
    status, err = _train_cli(capsys, config_file, "--out", tmp_path / "run")
    assert status == 2 and "Traceback" not in err
    assert f"train.jsonl {message}" in err, err
    assert not (tmp_path / "run").exists()


def test_dpo_without_init_from_and_a_changed_reference_exit_2_and_keep_the_run(
    tmp_path: Path, capsys
) -> None:
    base = save_chat_run(tmp_path / "base", n_layer=1, n_embed=16, context_length=32)
    config = dpo_config(base, tmp_path, max_steps=2)
    config_file = tmp_path / "dpo.yaml"
    config_file.write_text(dump_yaml(config).replace(f"init_from: {base}", "init_from: null"))
    status, err = _train_cli(capsys, config_file, "--out", tmp_path / "run")
    assert status == 2 and "set train.init_from to a run directory" in err, err
    assert not (tmp_path / "run").exists()

    config_file.write_text(dump_yaml(config))
    assert _train_cli(capsys, config_file, "--out", tmp_path / "run")[0] == 0
    saved = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()}
    # The reference run trained on: its tokenizer is not the one the DPO run scored pairs with.
    save_tiny_run(base, CharTokenizer(CHARS + "#"), {"data": {"format": "chat"}})
    status, err = _train_cli(
        capsys, config_file, "--out", tmp_path / "run", "--set", "train.max_steps=4", "--resume"
    )
    assert status == 2 and "now has another tokenizer than this DPO run" in err, err
    after = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()}
    assert after == saved


def test_pairs_drawn_more_than_once_are_scored_by_the_reference_once(tmp_path: Path) -> None:
    base = save_chat_run(tmp_path / "base", n_layer=1, n_embed=16, context_length=32)
    config = resolve_init_from(dpo_config(base, tmp_path, max_steps=3))  # 12 draws, 12 pairs
    tokenizer = load_tokenizer_file(base)
    pairs = preference_token_data(config.data, 32, tokenizer, default_template()).preference
    reference = build.reference_model(config, tokenizer.vocab_size, torch.device("cpu"))
    assert not score_pairs_once(reference, pairs, config, world_size=1)
    assert pairs.train.reference_logps is None  # each pair drawn about once: scored in the steps
    assert score_pairs_once(reference, pairs, config, world_size=2)  # 24 draws
    for split in (pairs.train, pairs.val):
        for k in range(len(split)):  # each pair alone, unpadded: the same scores
            ids, mask = pair_batch(split, [k], pairs.pad_id)
            with torch.no_grad():
                alone = completion_logps(reference, ids, mask)
            np.testing.assert_allclose(split.reference_logps[k], alone.numpy(), atol=1e-5)
    # The sampler hands the scores on in its rows' order: a step scored from them is the step
    # scored by the reference itself.
    sampler = PreferenceSampler(pairs.train, pairs.pad_id, 4, 32, seed=1)
    ids, mask, scores = sampler.next()
    policy = Transformer(config.model, tokenizer.vocab_size)
    load_init_weights(policy, str(base))
    cached, cached_metrics = dpo_step(policy, scores, ids, mask, DPOLoss(0.5))
    live, live_metrics = dpo_step(policy, reference, ids, mask, DPOLoss(0.5))
    assert cached.item() == pytest.approx(live.item(), abs=1e-6)
    for name in live_metrics:
        assert cached_metrics[name].item() == pytest.approx(live_metrics[name].item(), abs=1e-5)


def test_a_run_with_loss_types_and_weights_trains_on_their_sum_and_logs_the_logits(
    tmp_path: Path, capsys
) -> None:
    base = save_chat_run(tmp_path / "base", n_layer=1, n_embed=16, context_length=32)
    config = dpo_config(base, tmp_path, max_steps=4)
    config_file = tmp_path / "dpo.yaml"
    config_file.write_text(dump_yaml(config))
    rpo = ("--set", "train.loss_type=sigmoid,sft", "--set", "train.loss_weights=1.0,0.5")
    status, err = _train_cli(capsys, config_file, "--out", tmp_path / "run", *rpo)
    assert status == 0, err
    saved = load_run(tmp_path / "run").config.train
    assert (saved.loss_types, saved.loss_weight_values) == (["sigmoid", "sft"], [1.0, 0.5])

    # Step 1 by hand: the policy is the reference, so the sigmoid term is log 2 and the sft term
    # the chosen replies' negative log-likelihood per token, at half weight.
    resolved = resolve_init_from(config)
    tokenizer = load_tokenizer_file(base)
    data = preference_token_data(resolved.data, 32, tokenizer, default_template()).preference
    ids, mask = PreferenceSampler(data.train, data.pad_id, 4, 32, seed=5).next()
    initial = Transformer(resolved.model, tokenizer.vocab_size)
    load_init_weights(initial, str(base))
    initial.eval()
    with torch.no_grad():
        logps = completion_logps(initial, ids, mask)[:4]  # the chosen rows'
        _, metrics = dpo_step(initial, initial, ids, mask, DPOLoss(0.5, ("sigmoid", "sft")))
    nll = -logps.sum().item() / mask[:4, 1:].sum().item()
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert records[0]["train_loss"] == pytest.approx(math.log(2) + 0.5 * nll, abs=1e-5)
    for name in ("logits/chosen", "logits/rejected"):
        assert records[0][name] == pytest.approx(metrics[name].item(), abs=1e-5), name
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    row = "beta 0.5, loss sigmoid,sft, weighted 1.0,0.5 against"
    assert row in format_info(run_info(tmp_path / "run"))

    status, err = _train_cli(
        capsys, config_file, "--out", tmp_path / "typo", "--set", "train.loss_type=sigmod"
    )
    assert status == 2 and "Did you mean 'sigmoid'?" in err and "Traceback" not in err, err
    assert not (tmp_path / "typo").exists()
