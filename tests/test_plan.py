"""`llmcli plan` (llmcli/training/plan.py, llmcli/cli/plan.py): the counts against the built
model and the textbook formulas, the memory against estimate_memory's formula written out, the
timing, the JSON fields, and a config whose data is missing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import small_run_config

import llmcli.device
from llmcli.cli import main
from llmcli.config import config_from_dict
from llmcli.data.tokens import prepare_data
from llmcli.model.gpt import Transformer
from llmcli.progress import format_bytes
from llmcli.training import plan as plan_module
from llmcli.training.plan import ASSUMED_VOCAB, format_plan, make_plan
from llmcli.training.step import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

JSON_FIELDS = {
    "params",
    "params_non_embedding",
    "params_trainable",
    "flops_per_token",
    "tokens_per_step",
    "memory",
    "memory_full_finetune",
    "device_free",
    "fits",
    "step_s",
    "eta_s",
}


def _raw(corpus: Path, **train: object) -> dict:
    raw = small_run_config(corpus, max_steps=100, eval_interval=30, eval_steps=5, **train)
    raw["model"].update(n_layer=2, n_embed=32, tie_embeddings=False)
    return raw


def test_plan_counts_the_built_model_and_the_formulas(small_corpus: Path) -> None:
    config = config_from_dict(_raw(small_corpus, grad_accum=3, memory_limit="1GiB"))
    plan = make_plan(config, "cpu")
    vocab = prepare_data(config.data, 16).tokenizer.vocab_size
    model = Transformer(config.model, vocab)
    named = dict(model.named_parameters())
    n = sum(p.numel() for p in named.values())
    embeddings = named["wte.weight"].numel() + named["wpe.weight"].numel()  # untied: lm_head stays
    B, L, T, C = 4, 2, 16, 32
    assert plan.vocab_size == vocab and plan.missing is None
    got = plan.to_json()
    assert set(got) == JSON_FIELDS
    assert got["params"] == n and got["params_non_embedding"] == n - embeddings
    assert got["flops_per_token"] == 6 * (n - embeddings) + 12 * L * T * C
    assert got["tokens_per_step"] == 4 * T * 3
    # llmcli/training/memory.py's formula, written out for this model (fp32 on the CPU, no
    # dropout): 4 bytes a value for the weights, the gradients and AdamW's two moments; what the
    # forward keeps, L (20 C) + 4 C + 4 V values per token (no attention weights: SDPA's fused
    # path), for the B x T tokens of a micro-batch; and the CPU runtime's 80 MiB.
    activations = B * T * 4 * (L * 20 * C + 4 * C + 4 * vocab)
    assert got["memory"] == {
        "weights": 4 * n,
        "grads": 4 * n,
        "optimizer": 8 * n,
        "activations": activations,
        "reference": 0,  # DPO's frozen model
        "sampling": 0,  # GRPO's completions, drawn before the step
        "peak": 16 * n + activations + 80 * 2**20,
    }
    assert got["device_free"] == 2**30 and got["fits"] is True
    timing = plan.timing
    assert timing is not None and timing.steps >= 1 and timing.batch == 4
    assert 0 < timing.forward_s < timing.step_s
    evals = 4  # steps 30, 60, 90 and the last, 100
    eta = timing.step_s * 100 + evals * 2 * 5 * timing.forward_s
    assert got["eta_s"] == pytest.approx(eta, abs=1e-3)
    text = format_plan(plan)
    assert f"{n:,} ({n - embeddings:,} without embeddings" in text
    assert f"{4 * T * 3:,} (4 sequences x 16 tokens x grad_accum 3)" in text
    assert "1.0 GiB (train.memory_limit): fits" in text and f"{evals} evaluations" in text
    tc = plan.config.train
    assert (
        f"lr {tc.lr:g} to {tc.min_lr:g} (cosine), warmup {tc.warmup} steps, evaluation every 30 "
        "steps"
    ) in text


def test_a_lora_plan_holds_gradients_and_moments_of_the_adapters_alone(
    small_corpus: Path, tmp_path: Path
) -> None:
    from conftest import save_tiny_run

    from llmcli.training.lora import adapt

    raw = _raw(small_corpus, memory_limit="1GiB")
    tokenizer = prepare_data(config_from_dict(raw).data, 16).tokenizer
    base = save_tiny_run(tmp_path / "base", tokenizer, {"model": raw["model"]})
    targets = ["attn.qkv", "mlp.fc"]
    raw["train"].update(init_from=str(base), lora={"rank": 4, "targets": targets})
    plan = make_plan(config_from_dict(raw), "cpu", measure_s=0.5)
    got = plan.to_json()
    vocab, L, C = plan.vocab_size, 2, 32
    n = Transformer(plan.config.model, vocab).num_parameters()
    # r (in + out) per adapted layer: the QKV C -> 3C and the MLP's first C -> 4C
    adapters = L * 4 * ((C + 3 * C) + (C + 4 * C))
    model = Transformer(plan.config.model, vocab)
    adapt(model, plan.config.train.lora, str(base), 0)  # as the run builds it
    assert adapters == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert got["params"] == n + adapters and got["params_trainable"] == adapters
    memory = got["memory"]
    assert memory["weights"] == 4 * (n + adapters)
    assert memory["grads"] == 4 * adapters and memory["optimizer"] == 8 * adapters
    assert f"{adapters:,} train: {adapters:,} in LoRA adapters (rank 4 on attn.qkv, mlp.fc)" in (
        format_plan(plan)
    )
    assert plan.timing is not None  # the adapted model's steps were timed
    # no weight gradients for the frozen base: 4 N, and 6 for each adapter parameter
    N, T = model.num_parameters(non_embedding=True) - adapters, plan.config.model.context_length
    assert got["flops_per_token"] == 4 * N + 6 * adapters + 12 * L * T * C

    full = make_plan(config_from_dict(_raw(small_corpus, init_from=str(base))), "cpu", 0.5)
    assert full.to_json()["params_trainable"] == n and full.memory.grads == 4 * n
    assert got["memory_full_finetune"] == full.to_json()["memory"]  # what LoRA saves, shown
    assert f"at most (training every weight: {format_bytes(full.memory.peak)})" in format_plan(plan)


def test_measuring_stays_within_its_budget(
    small_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fake clock that only training steps move: m micro-batches of b sequences take
    # m * b * 10 ms, plus 2 ms for the update. The warm-up step (1 sequence) takes 12 ms, a round
    # (1 then 2 micro-batches of 4) 124 ms; a round starts only while 3 x 12 ms x 4 is left of
    # the 0.3 s budget: two rounds, fewer than TIMED_STEPS.
    now = [0.0]
    real_step = plan_module.train_step

    def fake_step(trainer: Trainer) -> None:
        real_step(trainer)
        now[0] += trainer.grad_accum * len(trainer.batches.batch[0]) * 0.010 + 0.002

    clock = SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(plan_module, "time", clock)  # the budget
    monkeypatch.setattr(llmcli.device, "time", clock)  # each step (`llmcli.device.timed`)
    monkeypatch.setattr(plan_module, "train_step", fake_step)
    plan = make_plan(config_from_dict(_raw(small_corpus)), "cpu", measure_s=0.3)
    timing = plan.timing
    assert timing is not None and timing.batch == 4
    assert timing.steps == 2 < plan_module.TIMED_STEPS  # the budget stopped it
    assert timing.seconds == pytest.approx(0.012 + 2 * 0.124) and timing.seconds <= 0.3
    assert timing.step_s == pytest.approx(0.040 + 0.002)  # the fake's micro-batch and update


def test_ddp_world_size_from_the_environment(
    small_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = config_from_dict(_raw(small_corpus))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    plan = make_plan(config, "cpu", measure_s=0.1)
    n = sum(p.numel() for p in Transformer(config.model, plan.vocab_size).parameters())
    assert plan.to_json()["tokens_per_step"] == 4 * 16 * 4
    assert plan.memory.grads == 2 * 4 * n  # fp32, and DDP's buckets copy the gradients
    assert "x 4 processes" in format_plan(plan)


def test_a_run_that_does_not_fit_is_not_measured(small_corpus: Path) -> None:
    plan = make_plan(config_from_dict(_raw(small_corpus, memory_limit=1000)), "cpu")
    got = plan.to_json()
    assert got["fits"] is False and got["step_s"] is None and got["eta_s"] is None
    assert "does NOT fit" in format_plan(plan)


def test_plan_resolves_an_automatic_batch_as_train_does(small_corpus: Path) -> None:
    raw = _raw(small_corpus, memory_limit="1GiB")
    raw["train"].update(batch_size="auto", tokens_per_step=16 * 16)
    got = make_plan(config_from_dict(raw), "cpu", measure_s=0.1)
    assert got.config.train.batch_size == 16 and got.config.train.grad_accum == 1
    assert got.to_json()["tokens_per_step"] == 256


@pytest.mark.parametrize(
    ("data", "vocab", "said"),
    [
        ({"tokenizer": "char"}, ASSUMED_VOCAB, f"Vocabulary assumed: {ASSUMED_VOCAB} tokens."),
        ({"tokenizer": "bpe", "vocab_size": 300}, 300, "Vocabulary: data.vocab_size."),
    ],
)
def test_missing_data_still_plans_and_says_what_is_missing(
    tmp_path: Path, data: dict, vocab: int, said: str
) -> None:
    raw = _raw(tmp_path)
    raw["data"] = {"path": str(tmp_path / "nowhere.txt"), "cache_dir": str(tmp_path), **data}
    plan = make_plan(config_from_dict(raw), "cpu", measure_s=0.1)
    assert plan.vocab_size == vocab
    assert plan.missing is not None and "nowhere.txt" in plan.missing and said in plan.missing
    assert plan.to_json()["params"] == Transformer(plan.config.model, vocab).num_parameters()
    assert plan.timing is not None  # random tokens need no data
    assert format_plan(plan).splitlines()[-1].split(maxsplit=1) == ["missing", plan.missing]


def test_cli_prints_json_and_text_and_refuses_a_limit_below_the_weights(
    small_corpus: Path, tmp_path: Path, capsys
) -> None:
    config_file = tmp_path / "c.yaml"
    config_file.write_text(yaml.safe_dump(_raw(small_corpus)))
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(config_file), "--device", "cpu", "--json"])
    assert exit_.value.code == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got) == JSON_FIELDS and set(got["memory"]) == {
        "weights",
        "grads",
        "optimizer",
        "activations",
        "reference",
        "sampling",
        "peak",
    }
    assert got["fits"] is True and got["step_s"] > 0 and math.isfinite(got["eta_s"])

    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(config_file), "--set", "train.batch_size=auto"])
    assert exit_.value.code == 2
    assert "train.batch_size ('auto') needs train.tokens_per_step" in capsys.readouterr().err

    auto = ["--set", "train.batch_size=auto", "--set", "train.tokens_per_step=64"]
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(config_file), *auto, "--set", "train.memory_limit=10KB"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "smallest limit that works is" in err and "Traceback" not in err
