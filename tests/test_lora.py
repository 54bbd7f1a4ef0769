"""LoRA (`train.lora`; llmcli/model/lora.py, llmcli/training/lora.py): the adapted layer against
its formula, merging against the adapted forward, a chat fine-tune from a text run that changes
only the adapters and the new token rows, a resumed LoRA run bitwise the uninterrupted one, DPO
with adapters against the reference without them, and bad settings through `llmcli train`.

The base is a 1-layer model of width 16 on a char vocabulary, so a run takes about a second.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from chat_helpers import CHARS, save_chat_run
from conftest import save_tiny_run

from llmcli.config import Config, LoraConfig, ModelConfig, config_from_dict, dump_yaml
from llmcli.data.tokenizer import CharTokenizer
from llmcli.model.gpt import Transformer
from llmcli.model.lora import (
    LoRALinear,
    adapted_layers,
    add_lora,
    merge_lora,
    merged_state_dict,
)
from llmcli.runs.formats import read_weights
from llmcli.runs.loading import load_run
from llmcli.runs.metrics import read_metrics
from llmcli.training.loop import train
from llmcli.training.state import ResumeState

pytestmark = pytest.mark.usefixtures("one_thread")

BASE_MODEL = {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 32}
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def with_random_b(model: torch.nn.Module, seed: int = 1) -> None:
    """Fill every adapter's B (zeros at first, so an adapter starts as a no-op) with values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in adapted_layers(model):
            layer.lora_B.normal_(0.0, 0.5, generator=generator)


# --- the layer and merging --------------------------------------------------------------------


def test_the_defaults_are_pefts() -> None:
    import peft

    theirs, ours = peft.LoraConfig(), LoraConfig()
    assert (ours.rank, ours.alpha, ours.dropout) == (
        theirs.r,
        theirs.lora_alpha,
        theirs.lora_dropout,
    )


def test_the_adapted_layer_is_its_formula() -> None:
    base = torch.nn.Linear(6, 5)
    layer = LoRALinear(base, LoraConfig(rank=3, alpha=4.0), torch.Generator().manual_seed(0))
    assert layer.weight is base.weight and layer.bias is base.bias  # shared, not copied
    assert layer.lora_A.shape == (3, 6) and layer.lora_B.shape == (5, 3)
    assert not layer.lora_B.any()  # B starts at zero: the adapted layer starts as the base
    with_random_b(layer)
    x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(2))
    W, b = base.weight.detach().numpy(), base.bias.detach().numpy()
    A, B = layer.lora_A.detach().numpy(), layer.lora_B.detach().numpy()
    xs = x.numpy().astype(np.float64)
    by_hand = xs @ W.T + b + (xs @ A.T @ B.T) * (4.0 / 3)
    np.testing.assert_allclose(layer(x).detach().numpy(), by_hand, rtol=1e-5, atol=1e-6)
    # PEFT's init of A: kaiming_uniform_(a=sqrt(5)), bound 1/sqrt(in_features)
    assert layer.lora_A.abs().max() <= 1 / math.sqrt(6)


def test_dropout_falls_on_the_adapters_input_only_in_training() -> None:
    layer = LoRALinear(torch.nn.Linear(8, 8), LoraConfig(rank=2, dropout=0.5))
    with_random_b(layer)
    x = torch.randn(4, 8)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    torch.manual_seed(0)
    assert not torch.allclose(layer(x), layer(x))


def test_the_merged_weights_equal_the_adapted_model() -> None:
    config = ModelConfig(n_layer=2, n_head=2, n_embed=16, context_length=8, dropout=0.0)
    model = Transformer(config, 20, generator=torch.Generator().manual_seed(0))
    names = list(model.state_dict())
    add_lora(model, LoraConfig(rank=4, alpha=8.0), torch.Generator().manual_seed(1))
    with_random_b(model)
    model.eval()
    idx = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(2))
    adapted = model(idx)[0]

    merged = merged_state_dict(model)
    assert list(merged) == names  # the base's names, no adapters
    plain = Transformer(config, 20).eval()
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain(idx)[0], adapted, rtol=0, atol=1e-5)

    merge_lora(model)
    assert not list(adapted_layers(model)) and list(model.state_dict()) == names
    torch.testing.assert_close(model(idx)[0], adapted, rtol=0, atol=1e-5)


def test_a_rank_larger_than_a_layer_is_refused() -> None:
    with pytest.raises(ValueError, match=r"train.lora.rank \(9\) is larger .* at most 8"):
        LoRALinear(torch.nn.Linear(8, 24), LoraConfig(rank=9))


# --- training --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_base(tmp_path_factory) -> Path:
    """A plain-text run without the chat tokens: a chat fine-tune grows its vocabulary."""
    return save_tiny_run(
        tmp_path_factory.mktemp("base") / "run",
        CharTokenizer(CHARS),
        {"model": BASE_MODEL},
        sharpen=3.0,
    )


def conversation(i: int) -> dict:
    a, b = LETTERS[i % 26], LETTERS[(3 * i) % 26]
    return {
        "messages": [
            {"role": "user", "content": f"spell {a}{b}"},
            {"role": "assistant", "content": f"{a}-{b}"},
        ]
    }


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def lora_config(base: Path, folder: Path, lora: dict | None = None, **train: object) -> Config:
    raw = {
        "data": {
            "format": "chat",
            "path": str(write_jsonl(folder / "train.jsonl", [conversation(i) for i in range(32)])),
            "val_path": str(write_jsonl(folder / "val.jsonl", [conversation(i) for i in range(8)])),
            "cache_dir": str(folder / "cache"),
        },
        "train": {
            "init_from": str(base),
            "lora": {"rank": 4, "alpha": 8, **(lora or {})},
            "device": "cpu",
            "batch_size": 4,
            "max_steps": 8,
            "warmup_steps": 1,
            "lr": 1e-2,
            "eval_interval": 4,
            "eval_steps": 1,
            "log_interval": 1,
            "seed": 3,
            **train,
        },
    }
    return config_from_dict(raw, name="lora")


def test_a_lora_run_changes_only_the_adapters_and_the_new_token_rows(
    text_base: Path, tmp_path: Path
) -> None:
    config = lora_config(text_base, tmp_path)
    out = tmp_path / "run"
    train(config, out_dir=out, progress=False)
    losses = [r["train_loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert losses[-1] < losses[0]

    base, _ = read_weights(text_base / "model.safetensors")
    V0 = base["wte.weight"].shape[0]  # the chat tokens come after the base's rows
    trained = ResumeState.load(out).model  # the unmerged weights, adapters beside them
    adapters = {n for n in trained if n.endswith((".lora_A", ".lora_B"))}
    assert len(adapters) == 2 * 4  # A and B on each of the four layers of the one block
    assert all(trained[n].any() for n in adapters if n.endswith("lora_B"))  # they trained
    for name, tensor in base.items():
        if name == "wte.weight":  # the base's rows frozen, the chat tokens' rows trained
            assert torch.equal(trained[name][:V0], tensor)
            assert trained[name].shape[0] > V0
        else:
            assert torch.equal(trained[name], tensor), f"{name} changed"
    mean_row = base["wte.weight"].mean(dim=0)  # init_from's start for the new rows
    assert all(not torch.equal(row, mean_row) for row in trained["wte.weight"][V0:])

    # model.safetensors holds the merged weights: the plain model the adapted one equals,
    # which every reader of a run loads as it is.
    saved, _ = read_weights(out / "model.safetensors")
    run = load_run(out)
    assert set(saved) == set(base) and not any("lora" in n for n in saved)
    peft_config = json.loads((out / "adapter_config.json").read_text())
    V = trained["wte.weight"].shape[0]
    assert peft_config["trainable_token_indices"] == list(range(V0, V))  # the chat tokens
    counts = json.loads((out / "meta.json").read_text())["lora"]
    assert counts["base_vocab_size"] == V0
    assert counts["adapters"] == 4 * ((16 + 48) + (16 + 16) + (16 + 64) + (64 + 16))
    assert counts["trainable"] >= counts["adapters"] + trained["wte.weight"].numel()
    idx = torch.randint(0, V0, (2, 16), generator=torch.Generator().manual_seed(0))
    adapted = Transformer(run.config.model, trained["wte.weight"].shape[0])
    add_lora(adapted, config.train.lora)
    adapted.load_state_dict(trained)
    adapted.eval()
    torch.testing.assert_close(run.model(idx)[0], adapted(idx)[0], rtol=0, atol=1e-5)


def test_a_resumed_lora_run_is_bitwise_the_uninterrupted_one(
    text_base: Path, tmp_path: Path, ctrl_c_raises
) -> None:
    # The adapters' dropout on: the resumed run must also draw the masks the other one drew.
    config = lora_config(text_base, tmp_path, {"dropout": 0.1}, max_steps=10, eval_interval=5)
    straight = tmp_path / "straight"
    train(config, out_dir=straight, progress=False)

    def interrupt(step: int) -> None:
        if step == 5:
            signal.raise_signal(signal.SIGINT)

    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        train(config, out_dir=resumed, progress=False, on_step=interrupt)
    summary = train(config, out_dir=resumed, resume=True, progress=False)
    assert summary.resumed_from == 5 and summary.step == 10
    for name in ("model.safetensors",):
        a, b = (read_weights(run / name)[0] for run in (straight, resumed))
        for key in a:
            assert torch.equal(a[key], b[key]), f"{key} differs bitwise"
    a, b = (ResumeState.load(run).model for run in (straight, resumed))
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs bitwise"
    drop = ("elapsed_s", "tok_per_s", "mfu")
    records = [
        [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(run / "metrics.jsonl")]
        for run in (straight, resumed)
    ]
    assert records[0] == records[1]


def test_under_muon_the_adapters_train_with_adamw(text_base: Path, tmp_path: Path) -> None:
    from llmcli.training.optim import build_optimizer

    config = lora_config(text_base, tmp_path, optimizer="muon", max_steps=3, eval_interval=3)
    model = load_run(text_base).model
    add_lora(model, config.train.lora)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(("lora_A", "lora_B")))
    optimizer = build_optimizer(model, config.train, "cpu")
    muon, adamw = (
        [n for g in optimizer.param_groups if g["use_muon"] == kind for n in g["names"]]
        for kind in (True, False)
    )
    assert muon == [] and len(adamw) == 8  # A and B of the block's four layers
    out = tmp_path / "run"
    train(config, out_dir=out, progress=False)  # an empty Muon group steps as nothing
    assert ResumeState.load(out).model["blocks.0.attn.qkv.lora_B"].any()


def test_dpo_with_lora_starts_at_log_2_against_the_reference_without_adapters(
    tmp_path: Path,
) -> None:
    base = save_chat_run(tmp_path / "base", n_layer=1, n_embed=16, context_length=32)
    rows = [
        {
            "prompt": [{"role": "user", "content": f"spell {LETTERS[i]}"}],
            "chosen": [{"role": "assistant", "content": f"{LETTERS[i]}"}],
            "rejected": [{"role": "assistant", "content": "no idea"}],
        }
        for i in range(12)
    ]
    raw = {
        "model": {"dropout": 0.0},
        "data": {
            "format": "preference",
            "path": str(write_jsonl(tmp_path / "pairs.jsonl", rows)),
            "val_path": str(write_jsonl(tmp_path / "val.jsonl", rows[:4])),
        },
        "train": {
            "objective": "dpo",
            "init_from": str(base),
            "lora": {"rank": 2},
            "device": "cpu",
            "batch_size": 4,
            "max_steps": 6,
            "warmup_steps": 1,
            "lr": 1e-2,
            "eval_interval": 6,
            "eval_steps": 1,
            "log_interval": 1,
        },
    }
    out = tmp_path / "dpo"
    train(config_from_dict(raw, name="dpo"), out_dir=out, progress=False)
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    # B = 0: the policy is the reference at step 1, and its log-ratios are 0
    assert records[0]["train_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert records[-1]["rewards/margins"] > 0  # the adapters learn to prefer the chosen
    trained = ResumeState.load(out).model
    base_weights, _ = read_weights(base / "model.safetensors")
    for name, tensor in base_weights.items():  # no new tokens: the base is frozen whole
        assert torch.equal(trained[name], tensor), f"{name} changed"

    # The run's adapters in PEFT's format, loaded onto the exported base, are the run's model.
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 2
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from llmcli.hf.export import export_hf

    export_hf(base, tmp_path / "hf", fmt="gpt2")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    adapted = peft.PeftModel.from_pretrained(hf, out).eval()
    idx = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = load_run(out, weights="last", device="cpu").model(idx)[0]
        torch.testing.assert_close(adapted(idx).logits, ours, rtol=0, atol=1e-4)


# --- bad input through the command -----------------------------------------------------------


def cli(capsys, *args: object) -> tuple[int, str]:
    """Run `llmcli` in this process: (exit status, stderr on one line)."""
    from llmcli.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    return exc.value.code, " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["train.lora.rank=4"], r"train.lora .*set train.init_from"),
        (["train.lora.rank=0", "train.init_from=BASE"], r"train.lora.rank \(0\) must be >= 1"),
        (["train.lora.rank=17", "train.init_from=BASE"], r"rank \(17\) is larger .* at most 16"),
        (["train.lora.alpha=0", "train.init_from=BASE"], r"train.lora.alpha \(0.0\) must be > 0"),
        (["train.lora.dropout=1", "train.init_from=BASE"], r"dropout \(1.0\) must be in \[0, 1\)"),
        (["train.lora.rnak=4", "train.init_from=BASE"], r"Did you mean 'train.lora.rank'"),
    ],
)
def test_bad_lora_settings_exit_2_naming_the_fix(
    text_base: Path, tmp_path: Path, capsys, sets: list[str], message: str
) -> None:
    config = tmp_path / "lora.yaml"
    config.write_text(dump_yaml(config_from_dict({"model": BASE_MODEL})))
    args = [a for s in sets for a in ("--set", s.replace("BASE", str(text_base)))]
    code, err = cli(capsys, "train", config, "--out", tmp_path / "run", *args)
    assert code == 2 and re.search(message, err), err
    assert not (tmp_path / "run").exists()


def test_unknown_targets_exit_2_naming_the_layers(text_base: Path, tmp_path: Path, capsys) -> None:
    config = tmp_path / "lora.yaml"
    raw = config_from_dict({"model": BASE_MODEL}).to_dict()
    raw["train"].update(init_from=str(text_base), lora={"targets": ["attn.c_attn"]})
    config.write_text(json.dumps(raw))  # JSON is YAML
    code, err = cli(capsys, "train", config, "--out", tmp_path / "run")
    assert code == 2
    assert "'attn.c_attn' is not a layer" in err and "attn.qkv, attn.proj, mlp.fc, mlp.proj" in err


def test_the_config_keeps_lora_through_its_yaml() -> None:
    config = config_from_dict({"train": {"init_from": "x", "lora": {"rank": 2}}})
    again = config_from_dict(yaml.safe_load(dump_yaml(config)))
    assert again.train.lora == dataclasses.replace(LoraConfig(), rank=2)


# --- PEFT's format ---------------------------------------------------------------------------

# The three layouts: GPT-2 (Conv1D, fan_in_fan_out), GPT-NeoX (QKV rows by head), Arcee (q, k, v)
ARCHITECTURES = {
    "gpt2": {},
    "gpt-neox": {"pos_emb": "rope"},
    "arcee": {"pos_emb": "rope", "norm": "rmsnorm"},
}


def write_adapter(folder: Path, model: torch.nn.Module, lora: LoraConfig, arch, base: str) -> Path:
    from llmcli.hf.lora import peft_adapter_files

    folder.mkdir()
    for name, data in peft_adapter_files(model, lora, arch, base).items():
        (folder / name).write_bytes(data)
    return folder


def assert_peft_equals(
    hf_folder: Path, adapter: Path, ours: torch.nn.Module, idx: torch.Tensor | None = None
) -> None:
    """PEFT's adapter on the Hugging Face base, and PEFT's merge of it, give `ours`'s logits
    (on `idx`, by default random characters)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_folder, local_files_only=True)
    adapted = peft.PeftModel.from_pretrained(hf, adapter).eval()
    if idx is None:
        idx = torch.randint(0, len(CHARS), (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(idx)[0]
        torch.testing.assert_close(adapted(idx).logits, expected, rtol=0, atol=1e-4)
        merged = adapted.merge_and_unload()
        torch.testing.assert_close(merged(idx).logits, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "targets"),
    [
        ("gpt2", None),
        ("gpt2", ["attn.proj"]),
        ("gpt2", ["mlp.proj", "attn.qkv"]),
        ("gpt-neox", None),
        ("arcee", None),
        ("arcee", ["attn.qkv"]),
    ],
)
def test_peft_loads_the_adapter_onto_the_exported_base_with_equal_logits(
    tmp_path: Path, name: str, targets: list[str] | None
) -> None:
    pytest.importorskip("peft")
    from llmcli.hf.architectures import ARCHITECTURES as LAYOUTS
    from llmcli.hf.export import export_hf

    arch = LAYOUTS[name]
    model_cfg = {**BASE_MODEL, **ARCHITECTURES[name], "dropout": 0.0}
    base = save_tiny_run(tmp_path / "base", CharTokenizer(CHARS), {"model": model_cfg})
    export_hf(base, tmp_path / "hf", fmt=name)
    model = load_run(base, device="cpu").model
    lora = LoraConfig(rank=4, alpha=8.0, **({"targets": targets} if targets else {}))
    add_lora(model, lora, torch.Generator().manual_seed(1))
    with_random_b(model)  # a trained adapter: B is not zero
    model.eval()
    adapter = write_adapter(tmp_path / "adapter", model, lora, arch, str(tmp_path / "hf"))

    # PEFT adapts exactly the targeted layers (GPT-2's two c_proj told apart by their parents,
    # Arcee's q, k and v for the fused QKV)
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    adapted = peft.PeftModel.from_pretrained(hf, adapter)
    theirs_adapted = {n for n, m in adapted.named_modules() if hasattr(m, "lora_A")}
    ours_adapted = {
        "base_model.model." + module
        for n, layer in adapted_layers(model)
        for module in arch.lora_to_hf(n, layer.lora_B, model.n_head)
    }
    assert theirs_adapted == ours_adapted
    assert_peft_equals(tmp_path / "hf", adapter, model)


def text_lora_run(folder: Path, model: dict) -> Path:
    """A LoRA text run on a base of the same vocabulary (so no token rows train): 4 steps."""
    base = save_tiny_run(folder / "base", CharTokenizer(CHARS), {"model": model}, sharpen=3.0)
    text = folder / "corpus.txt"
    text.write_text(" ".join(f"spell {a}{b}" for a in LETTERS for b in LETTERS[:6]))
    raw = {
        "model": {"dropout": 0.0},
        "data": {"path": str(text), "cache_dir": str(folder / "cache")},
        "train": {
            "init_from": str(base),
            "lora": {"rank": 2, "alpha": 4, "targets": ["attn.qkv", "mlp.fc"]},
            "device": "cpu",
            "batch_size": 4,
            "max_steps": 4,
            "warmup_steps": 1,
            "lr": 1e-2,
            "eval_interval": 4,
            "eval_steps": 1,
            "log_interval": 1,
        },
    }
    train(config_from_dict(raw, name="lora-text"), out_dir=folder / "run", progress=False)
    return folder / "run"


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_llmcli_export_writes_the_base_and_the_adapter_or_the_merged_model(
    tmp_path: Path, name: str
) -> None:
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from llmcli.hf.export import export_hf

    run = text_lora_run(tmp_path, {**BASE_MODEL, **ARCHITECTURES[name]})
    config = json.loads((run / "adapter_config.json").read_text())  # the run's own, each save
    assert config["r"] == 2 and len(config["target_modules"]) == (4 if name == "arcee" else 2)
    ours = load_run(run, weights="last").model  # the merged weights: the model the run trained

    result = export_hf(run, tmp_path / "hf", weights="last")
    assert result.architecture == name and result.adapter_dir == tmp_path / "hf" / "adapter"
    adapter_config = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((tmp_path / "hf").resolve())
    assert not (tmp_path / "hf" / "adapter_config.json").exists()  # transformers would follow it
    # The base is bitwise the weights the run started from, not the merged weights.
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    start = load_run(tmp_path / "base").model
    idx = torch.randint(0, len(CHARS), (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(base(idx).logits, start(idx)[0], rtol=0, atol=1e-5)
        assert (ours(idx)[0] - start(idx)[0]).abs().max() > 1e-2  # the adapters trained
    assert_peft_equals(tmp_path / "hf", result.adapter_dir, ours)

    # --force over the base + adapter export: the adapter must not stay to apply twice
    merged = export_hf(run, tmp_path / "hf", weights="last", merge=True, force=True)
    assert merged.adapter_dir is None and not (tmp_path / "hf" / "adapter").exists()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx)[0], rtol=0, atol=1e-4)


def test_the_best_steps_adapters_are_kept_beside_the_last_saves(tmp_path: Path) -> None:
    from llmcli.errors import CheckpointError
    from llmcli.hf.lora import saved_adapted_model
    from llmcli.model.lora import adapter_state_dict

    run = text_lora_run(tmp_path, BASE_MODEL)  # its best step is its last, 4
    config = load_run(run).config
    last = adapter_state_dict(saved_adapted_model(run, config.model, config.train.lora))
    best = adapter_state_dict(saved_adapted_model(run, config.model, config.train.lora, 4))
    assert last.keys() == best.keys() and len(best) == 4
    assert all(torch.equal(last[name], best[name]) for name in best)
    with pytest.raises(CheckpointError, match="adapters of step 4, not of the best .* step 3"):
        saved_adapted_model(run, config.model, config.train.lora, 3)


def test_info_shows_the_adapters_size(tmp_path: Path) -> None:
    from llmcli.runs.info import format_info, run_info

    run = text_lora_run(tmp_path, BASE_MODEL)
    info = run_info(run)
    adapters = 2 * ((16 + 3 * 16) + (16 + 4 * 16))  # r (in + out): the QKV and the MLP's fc
    assert info["lora"] == {
        "rank": 2,
        "alpha": 4.0,
        "dropout": 0.0,
        "targets": ["attn.qkv", "mlp.fc"],
        "base": str(tmp_path / "base"),
        "adapter_parameters": adapters,
        "trainable_parameters": adapters,  # no new tokens: the adapters alone
        "peft_adapter": True,
    }
    assert info["model"]["parameters"] == load_run(tmp_path / "base").model.num_parameters()
    assert (
        f"rank 2, alpha 4 on attn.qkv, mlp.fc; {adapters:,} adapter parameters; base "
        in format_info(info)
    )
    assert run_info(tmp_path / "base")["lora"] is None


def test_a_chat_lora_run_exports_its_new_tokens_as_peft_trainable_tokens(
    text_base: Path, tmp_path: Path
) -> None:
    """A chat fine-tune of a text run: the chat tokens' rows train, and PEFT's adapter with its
    trainable tokens, on the exported base (those rows as the run started them), gives the
    run's logits on text that uses them."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from llmcli.hf.export import export_hf

    run = tmp_path / "run"
    train(lora_config(text_base, tmp_path), out_dir=run, progress=False)
    result = export_hf(run, tmp_path / "hf", weights="last")
    ours = load_run(run, weights="last").model
    V, V0 = ours.vocab_size, json.loads((run / "meta.json").read_text())["lora"]["base_vocab_size"]
    config = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert config["trainable_token_indices"] == list(range(V0, V))

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    wte = base.get_input_embeddings().weight.detach()
    start = load_run(text_base).model.wte.weight.detach()
    assert torch.equal(wte[:V0], start)  # the base's rows, and its mean in the new ones
    assert all(torch.equal(row, start.mean(dim=0)) for row in wte[V0:])
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    idx[:, ::3] = torch.arange(V0, V).repeat(6)[: idx[:, ::3].numel()].view(2, -1)
    assert_peft_equals(tmp_path / "hf", result.adapter_dir, ours, idx)


def test_an_untied_heads_new_rows_are_exported_merged(tmp_path: Path) -> None:
    """PEFT's trainable tokens reach the input embedding only: the rows a run adds to an
    untied LM head have no place in its adapter files, so there are none and the export
    asks for --merge."""
    from llmcli.hf.lora import adapter_layout
    from llmcli.model.lora import freeze_base, train_token_rows

    model_cfg = ModelConfig(**BASE_MODEL, tie_embeddings=False)
    model = Transformer(model_cfg, 40)
    add_lora(model, LoraConfig(rank=2))
    freeze_base(model)
    assert adapter_layout(model, model_cfg) is not None  # no new rows: the adapters fit
    train_token_rows(model, 36)
    assert adapter_layout(model, model_cfg) is None
