"""Hugging Face GPT-2 interoperability (llmcli/hf/): export, `train.init_from`, bad input.

The reference is `transformers` itself: an exported folder is loaded with
`AutoModelForCausalLM` / `AutoTokenizer` (offline, from the local folder) and must give the same
logits (1e-5, fp32), the same token ids and the same greedy text as llmcli; a tiny random
`GPT2LMHeadModel` saved to a temporary folder must load into llmcli with the same logits.
Each comparison prints its max abs difference (`pytest -s` shows them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import cache_repo
from hf_helpers import PROMPT, TEXT, assert_close, cli, greedy_llmcli, make_run

from llmcli.config import Config, DataConfig, ModelConfig, SampleConfig, TrainConfig
from llmcli.data.tokenizer import BPETokenizer, CharTokenizer, load_tokenizer
from llmcli.errors import InputError
from llmcli.hf import export as hf_export
from llmcli.hf import load as hf_import
from llmcli.model.gpt import Transformer
from llmcli.runs.directory import METRICS_FILE, MODEL_FILE, save_model_run
from llmcli.runs.formats import read_weights
from llmcli.runs.loading import load_config_file, load_run


@pytest.fixture(autouse=True)
def _offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, opts",
    [
        ("char", {}),
        ("bpe", {}),
        ("char", {"bias": False, "tie_embeddings": False, "mlp": "relu2"}),
    ],
    ids=["char", "bpe", "char-nobias-untied-relu2"],
)
def test_export_loads_in_transformers_with_equal_logits_and_greedy_text(tmp_path, kind, opts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = make_run(tmp_path / "run", kind, **opts)
    out = tmp_path / "hf"
    assert cli("export", "--checkpoint", run, "--out", out) == 0
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        assert (out / name).is_file(), name

    loaded = load_run(run)
    ours, tok = loaded.model, loaded.tokenizer
    theirs = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    hf_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    cfg = theirs.config
    assert (cfg.model_type, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.n_positions) == (
        "gpt2",
        2,
        4,
        32,
        96,
    )
    assert cfg.vocab_size == tok.vocab_size
    assert cfg.tie_word_embeddings == opts.get("tie_embeddings", True)
    assert cfg.activation_function == opts.get("mlp", "gelu")
    assert cfg.eos_token_id == tok.eot_id is not None  # <|endoftext|>, char and BPE

    # Tokenizers agree on ids and text (the prompt and the whole corpus).
    for text in (PROMPT, TEXT):
        assert hf_tok.encode(text) == tok.encode(text)
        assert hf_tok.decode(tok.encode(text)) == text

    ids = torch.tensor([tok.encode(TEXT)[:64], tok.encode(TEXT)[-64:]])
    with torch.no_grad():
        assert_close(theirs(ids).logits, ours(ids)[0], f"export {kind} {opts} logits")

    prompt = tok.encode(PROMPT)
    expected = greedy_llmcli(ours, prompt, 50)
    with torch.no_grad():
        generated = theirs.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=50,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert generated == expected
    assert hf_tok.decode(generated) == tok.decode(expected)
    assert len(set(expected)) > 1  # not a degenerate single-token loop


@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        ({"temperature": 0.0, "top_k": 5}, {"do_sample": False}),  # 0 is greedy: no sampling keys
        (
            {"temperature": 0.7, "top_k": 5, "top_p": 0.9},
            {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5},
        ),
    ],
    ids=["greedy", "sampled"],
)
def test_generation_config_holds_the_runs_sampling_defaults_and_the_context_length(
    tmp_path, sample, expected
):
    tok = CharTokenizer.train([TEXT])
    model_cfg = ModelConfig(n_layer=1, n_head=2, n_embed=16, context_length=16)
    sampling = SampleConfig(max_new_tokens=7, **sample)
    config = Config(model=model_cfg, data=DataConfig(tokenizer="char"), sample=sampling)
    save_model_run(tmp_path / "run", config, tok, Transformer(model_cfg, tok.vocab_size))
    assert cli("export", "--checkpoint", tmp_path / "run", "--out", tmp_path / "hf") == 0
    got = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    eot = tok.eot_id
    ids = {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot}
    assert got == {"max_new_tokens": 7, **expected, **ids}
    tokenizer_config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tokenizer_config["model_max_length"] == 16  # the context length, every position of it


def harness_rolling_nats(model, ids: list[int], prefix: int, T: int) -> float:
    """Total negative log-likelihood of `ids` as lm-evaluation-harness's `loglikelihood_rolling`
    computes it: disjoint windows of at most `T` predicted tokens, the first one predicted after
    the `prefix` token (the tokenizer's BOS), each later window with the previous tokens as
    context up to `T` inputs."""
    windows = [([prefix] + ids[: T - 1], ids[:T])]
    done = min(T, len(ids))
    while done < len(ids):
        end = min(done + T, len(ids))
        windows.append((ids[end - T - 1 : end - 1], ids[done:end]))
        done = end
    total = 0.0
    with torch.no_grad():
        for inputs, predicted in windows:
            logits = model(torch.tensor([inputs])).logits[0, -len(predicted) :]
            total += torch.nn.functional.cross_entropy(
                logits, torch.tensor(predicted), reduction="sum"
            ).item()
    return total


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_export_meets_the_evaluation_harness_contract(tmp_path, kind):
    """What `lm_eval --model hf` relies on: BOS/EOS ids, decodable EOS, and a rolling
    log-likelihood that matches `llmcli eval` (here within 0.5% in bits per byte)."""
    import math

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcli.evaluation.run import EvalOptions, evaluate_run

    run, out, text_file = make_run(tmp_path / "run", kind), tmp_path / "hf", tmp_path / "t.txt"
    text_file.write_text(TEXT * 32)
    assert cli("export", "--checkpoint", run, "--out", out) == 0
    hf_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    theirs = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    eot = load_run(run).tokenizer.eot_id
    assert eot is not None and hf_tok.bos_token_id == hf_tok.eos_token_id == eot
    assert hf_tok.decode([hf_tok.eos_token_id]) == "<|endoftext|>"
    assert theirs.generation_config.eos_token_id == eot

    ids = hf_tok.encode(TEXT * 32)
    nats = harness_rolling_nats(theirs, ids, hf_tok.bos_token_id, theirs.config.n_positions)
    harness_bpb = nats / math.log(2) / len((TEXT * 32).encode("utf-8"))
    ours = evaluate_run(run, text_file, EvalOptions(device="cpu"))
    print(f"bits per byte: harness-style {harness_bpb:.5f}, llmcli eval {ours.bits_per_byte:.5f}")
    assert harness_bpb == pytest.approx(ours.bits_per_byte, rel=5e-3)


def test_old_char_run_without_end_of_text_exports_with_a_hint(tmp_path, caplog):
    run = make_run(tmp_path / "run", "char")
    old = CharTokenizer(CharTokenizer.train([TEXT]).chars, eot=None)  # a version 1 tokenizer
    old.save(run / "tokenizer.json")
    weights, _ = read_weights(run / "model.safetensors")
    config = load_config_file(run)
    model = Transformer(config.model, old.vocab_size)
    model.load_state_dict(
        {
            k: v[: old.vocab_size] if v.shape[0] == old.vocab_size + 1 else v
            for k, v in weights.items()
        },
        strict=False,
    )
    save_model_run(run, config, old, model)
    with caplog.at_level(logging.WARNING, logger="llmcli.hf"):
        assert cli("export", "--checkpoint", run, "--out", tmp_path / "hf") == 0
    assert f"prefix_token_id={old.encode(chr(10))[0]}" in caplog.text
    assert json.loads((tmp_path / "hf" / "special_tokens_map.json").read_text()) == {}


def test_export_writes_gpt2_conv1d_layout_and_zero_biases(tmp_path):
    from safetensors.torch import load_file

    run = make_run(tmp_path / "run", "char", bias=False)
    out = tmp_path / "hf"
    hf_export.export_hf(run, out)
    tensors = load_file(out / "model.safetensors")
    model = load_run(run).model
    qkv = model.blocks[0].attn.qkv.weight  # (3C, C)
    assert torch.equal(tensors["transformer.h.0.attn.c_attn.weight"], qkv.t())  # (C, 3C)
    fc = model.blocks[1].mlp.fc.weight  # (4C, C)
    assert torch.equal(tensors["transformer.h.1.mlp.c_fc.weight"], fc.t())  # (C, 4C)
    for name in (
        "transformer.h.0.attn.c_attn.bias",
        "transformer.h.1.mlp.c_proj.bias",
        "transformer.h.0.ln_1.bias",
        "transformer.ln_f.bias",
    ):
        assert not tensors[name].any(), name
    assert "lm_head.weight" not in tensors  # tied to transformer.wte.weight
    config = json.loads((out / "config.json").read_text())
    assert config["layer_norm_epsilon"] == model.ln_f.eps


@pytest.mark.parametrize(
    "opts, option",
    [
        ({"pos_emb": "rope"}, "model.pos_emb"),
        ({"norm": "rmsnorm"}, "model.norm"),
        ({"qk_norm": True}, "model.qk_norm"),
    ],
)
def test_export_refuses_options_gpt2_cannot_express(tmp_path, capsys, opts, option):
    run = make_run(tmp_path / "run", "char", **opts)
    args = ("export", "--checkpoint", run, "--out", tmp_path / "hf", "--format", "gpt2")
    assert cli(*args) == 2
    err = capsys.readouterr().err
    assert option in err and "GPT-2" in err
    assert not (tmp_path / "hf").exists()


def test_export_target_must_be_new_or_empty_unless_force(tmp_path, capsys):
    run = make_run(tmp_path / "run", "char")
    out = tmp_path / "hf"
    out.mkdir()
    assert cli("export", "--checkpoint", run, "--out", out) == 0  # empty folder: fine
    assert cli("export", "--checkpoint", run, "--out", out) == 2
    err = capsys.readouterr().err
    assert "exists and is not empty" in err and "--force" in err
    (out / "pytorch_model.bin").write_bytes(b"stale")
    assert cli("export", "--checkpoint", run, "--out", out, "--force") == 0
    assert not (out / "pytorch_model.bin").exists()  # it would shadow model.safetensors
    # The run directory itself is never a target, even with --force; nor is a file.
    assert cli("export", "--checkpoint", run, "--out", run, "--force") == 2
    assert "run directory itself" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert cli("export", "--checkpoint", run, "--out", tmp_path / "file") == 2
    assert "is a file" in capsys.readouterr().err
    assert cli("export", "--checkpoint", tmp_path / "nope", "--out", tmp_path / "hf2") == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli("export", "--checkpoint", run, "--out", tmp_path / "hf3", "--format", "ggml") == 2
    assert "--format 'ggml'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Import: train.init_from
# ---------------------------------------------------------------------------------------------


def save_tiny_gpt2(
    folder: Path, *, activation: str = "gelu", tie: bool = True, vocab_extra: int = 0, seed: int = 0
) -> BPETokenizer:
    """A randomly initialised GPT2LMHeadModel and its tokenizer, saved by transformers."""
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = BPETokenizer.train([TEXT], 300)
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=tok.vocab_size + vocab_extra,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        activation_function=activation,
        tie_word_embeddings=tie,
        bos_token_id=tok.eot_id,
        eos_token_id=tok.eot_id,
        initializer_range=0.2,
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # GPT-2 init zeroes biases and sets LayerNorm to identity: vary them
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.2 * torch.randn(p.shape))
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok.hf, eos_token="<|endoftext|>").save_pretrained(
        folder
    )
    return tok


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_load_gpt2_folder_equals_transformers(tmp_path, tie):
    tok = save_tiny_gpt2(tmp_path / "gpt2", tie=tie)
    loaded = hf_import.load_hf_folder(tmp_path / "gpt2")
    assert loaded.model_config.tie_embeddings == tie
    assert loaded.tokenizer.encode(TEXT) == tok.encode(TEXT)
    ids = torch.tensor([tok.encode(TEXT)[:32]])
    with torch.no_grad():
        ours = loaded.model(ids)[0]
    assert_close(ours, hf_logits(tmp_path / "gpt2", ids), f"import tie={tie} logits")


def test_tanh_gelu_checkpoint_loads_with_a_warning(tmp_path, caplog):
    tok = save_tiny_gpt2(tmp_path / "gpt2", activation="gelu_new")
    with caplog.at_level(logging.WARNING, logger="llmcli.hf"):
        loaded = hf_import.load_hf_folder(tmp_path / "gpt2")
    assert "gelu_new" in caplog.text
    ids = torch.tensor([tok.encode(TEXT)[:32]])
    with torch.no_grad():
        diff = (loaded.model(ids)[0] - hf_logits(tmp_path / "gpt2", ids)).abs().max().item()
    print(f"max_abs_diff gelu_new vs exact gelu: {diff:.3e}")
    assert diff < 1e-2  # the two GELUs differ by < 1e-3 per activation


def test_init_from_trains_its_own_run_from_the_gpt2_weights(tmp_path):
    from llmcli.training.loop import train

    tok = save_tiny_gpt2(tmp_path / "gpt2")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 3, encoding="utf-8")
    # A tiny learning rate: after a few steps the weights are still GPT-2's (to ~1e-9), which
    # shows that the run started from them; the shape comes from config.json, not from `model`.
    config = Config(
        model=ModelConfig(n_layer=1, n_head=2, n_embed=16, context_length=8),
        data=DataConfig(
            path=str(corpus), tokenizer="char", val_fraction=0.2, cache_dir=str(tmp_path / "cache")
        ),
        train=TrainConfig(
            device="cpu",
            dtype="float32",
            batch_size=2,
            max_steps=3,
            warmup_steps=0,
            lr=1e-9,
            min_lr=0.0,
            eval_interval=3,
            eval_steps=1,
            log_interval=1,
            init_from=str(tmp_path / "gpt2"),
        ),
    )
    run_dir = tmp_path / "run"
    train(config, out_dir=run_dir, progress=False)

    run = load_run(run_dir, weights="last")
    assert run.step == 3
    m = run.config.model
    assert (m.n_layer, m.n_head, m.n_embed, m.context_length) == (2, 4, 32, 32)
    assert run.config.data.tokenizer == str((tmp_path / "gpt2" / "tokenizer.json").resolve())
    assert run.config.train.init_from == str((tmp_path / "gpt2").resolve())
    assert run.tokenizer.to_json() == load_tokenizer(tmp_path / "gpt2" / "tokenizer.json").to_json()
    ids = torch.tensor([tok.encode(TEXT)[:32]])
    with torch.no_grad():
        ours = run.model(ids)[0]
    assert_close(ours, hf_logits(tmp_path / "gpt2", ids), "init_from run after 3 steps", 1e-4)
    assert (run_dir / METRICS_FILE).is_file()

    # Resuming with the same config continues the run from its own state (2 more steps).
    more = Config(
        model=config.model,
        data=config.data,
        sample=config.sample,
        train=dataclasses.replace(config.train, max_steps=5),
    )
    train(more, out_dir=run_dir, resume=True, progress=False)
    assert load_run(run_dir, weights="last").step == 5


def test_not_a_gpt2_folder_names_what_is_missing(tmp_path):
    folder = tmp_path / "gpt2"
    save_tiny_gpt2(folder)
    config = Config(train=TrainConfig(init_from=str(folder)))
    for name, what in (
        ("config.json", "config.json"),
        ("model.safetensors", "weights"),
        ("tokenizer.json", "tokenizer.json"),
    ):
        moved = folder / name
        moved.rename(tmp_path / name)
        with pytest.raises(InputError, match=f"lacks {what}"):
            hf_import.resolve_init_from(config)
        (tmp_path / name).rename(moved)
    with pytest.raises(InputError, match="does not exist"):
        hf_import.resolve_init_from(Config(train=TrainConfig(init_from=str(tmp_path / "nope"))))
    with pytest.raises(InputError, match="lacks config.json.*weights.*tokenizer.json"):
        hf_import.resolve_init_from(Config(train=TrainConfig(init_from=str(tmp_path))))


def test_other_model_types_and_options_are_refused(tmp_path):
    folder = tmp_path / "gpt2"
    save_tiny_gpt2(folder)
    config = Config(train=TrainConfig(init_from=str(folder)))
    original = json.loads((folder / "config.json").read_text())
    for change, message in (
        ({"model_type": "llama"}, "model_type is 'llama'.*'gpt2'"),
        ({"n_inner": 100}, "n_inner"),
        ({"activation_function": "silu"}, "activation_function"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ):
        (folder / "config.json").write_text(json.dumps({**original, **change}))
        with pytest.raises(InputError, match=message):
            hf_import.resolve_init_from(config)


def test_vocabulary_larger_than_the_tokenizer_is_refused(tmp_path):
    save_tiny_gpt2(tmp_path / "gpt2", vocab_extra=5)
    with pytest.raises(InputError, match="vocab_size .* larger than its tokenizer"):
        hf_import.resolve_init_from(Config(train=TrainConfig(init_from=str(tmp_path / "gpt2"))))


def test_exported_run_round_trips_through_init_from(tmp_path):
    run = make_run(tmp_path / "run", "bpe", seed=3)
    hf_export.export_hf(run, tmp_path / "hf")
    loaded = hf_import.load_hf_folder(tmp_path / "hf")
    original = load_run(run)
    ids = torch.tensor([original.tokenizer.encode(TEXT)[:64]])
    with torch.no_grad():
        assert_close(loaded.model(ids)[0], original.model(ids)[0], "export -> init_from logits", 0)


def test_init_from_a_hub_name_trains_on_from_the_cache(tmp_path, hub_cache, capsys):
    """`train.init_from: org/name` resolves through the Hugging Face cache (offline here), in
    any exported architecture; the run records the snapshot folder, so it needs no Hub later."""
    run = make_run(tmp_path / "run", "char", seed=5, pos_emb="rope", norm="rmsnorm")
    hf_export.export_hf(run, tmp_path / "export")
    snapshot = cache_repo(hub_cache, "org/tiny-arcee", {})
    for path in (tmp_path / "export").iterdir():  # weights too (bytes): copied as they are
        (snapshot / path.name).write_bytes(path.read_bytes())
    config = Config(train=TrainConfig(init_from="org/tiny-arcee"))
    resolved = hf_import.resolve_init_from(config)
    assert Path(resolved.train.init_from) == snapshot.resolve()
    assert (resolved.model.pos_emb, resolved.model.norm) == ("rope", "rmsnorm")
    loaded = hf_import.load_hf_folder("org/tiny-arcee")
    original = load_run(run)
    ids = torch.tensor([original.tokenizer.encode(TEXT)[:64]])
    with torch.no_grad():
        assert_close(loaded.model(ids)[0], original.model(ids)[0], "hub init_from logits", 0)

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 20)
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(
        f"data: {{path: {corpus}}}\n"
        "train: {device: cpu, max_steps: 2, warmup_steps: 0, eval_interval: 2, eval_steps: 1,"
        " batch_size: 2, init_from: org/tiny-arcee}\n"
    )
    assert cli("train", yaml_file, "--out", tmp_path / "trained") == 0
    gone = ("--set", "train.init_from=org/gone")
    assert cli("train", yaml_file, "--out", tmp_path / "x", *gone) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "train.init_from 'org/gone' is a Hugging Face Hub name that is not in the cache" in err
    assert "Traceback" not in err


def test_llmcli_train_with_a_bad_init_from_exits_2(tmp_path, capsys):
    save_tiny_gpt2(tmp_path / "gpt2", vocab_extra=3)
    (tmp_path / "empty").mkdir()
    config = tmp_path / "c.yaml"
    config.write_text("train: {device: cpu, max_steps: 2, warmup_steps: 0}\n")
    for folder, message in (
        (tmp_path / "empty", "lacks config.json"),
        (tmp_path / "gpt2", "larger than its tokenizer"),
    ):
        code = cli("train", config, "--out", tmp_path / "run", "--set", f"train.init_from={folder}")
        assert code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / MODEL_FILE).exists()


def test_gpt2model_names_and_pytorch_model_bin_load_too(tmp_path):
    """OpenAI's original GPT-2 files: no `transformer.` prefix, causal-mask buffers, a .bin."""
    from safetensors.torch import load_file

    folder = tmp_path / "gpt2"
    tok = save_tiny_gpt2(folder)
    tensors = load_file(folder / "model.safetensors")
    legacy = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    legacy["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))  # (1, 1, L, L) mask buffer
    expected = hf_logits(folder, ids := torch.tensor([tok.encode(TEXT)[:32]]))
    (folder / "model.safetensors").unlink()
    torch.save(legacy, folder / "pytorch_model.bin")
    with torch.no_grad():
        ours = hf_import.load_hf_folder(folder).model(ids)[0]
    assert_close(ours, expected, "import from pytorch_model.bin without prefix")
    (folder / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(InputError, match="pytorch_model.bin' is corrupt"):
        hf_import.load_hf_folder(folder)
