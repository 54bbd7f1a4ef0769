"""Reader fuzzing: random values in every field of a valid file are bad input or success, never
another exception.

For each kind of file llmcli reads (a run's `meta.json`, `metrics.jsonl`, `config.yaml` and
`state.pt` and safetensors weights; a `tokenizer.json` in llmcli's old char format and in the
Hugging Face format; a Hugging Face `config.json`), Hypothesis takes a valid file, puts a random
JSON (or YAML, or tensor) value in one of its fields, and runs the reader and what uses its
result. Informative
files (`meta.json`, `metrics.jsonl`) must always succeed and show only values of the right type;
the others must succeed or raise `InputError` naming the file. `test_readers.py` pins one case
of each class by hand.
"""

from __future__ import annotations

import copy
import json
import random
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from conftest import save_tiny_run, small_run_config
from hf_helpers import make_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmcli.config import Config, TrainConfig, config_from_dict
from llmcli.data.batches import BatchSampler
from llmcli.data.tokenizer import CharTokenizer, tokenizer_from_json
from llmcli.errors import InputError
from llmcli.hf.export import export_hf
from llmcli.hf.load import resolve_init_from
from llmcli.model.gpt import Transformer
from llmcli.runs.compare import compare_runs, format_table
from llmcli.runs.directory import CONFIG_FILE, META_FILE, METRICS_FILE, MODEL_FILE, STATE_FILE
from llmcli.runs.formats import load_weights, read_weights
from llmcli.runs.info import format_info, run_info
from llmcli.runs.loading import load_config_file
from llmcli.runs.metrics import NUMBER_FIELDS, plot_losses, read_metrics
from llmcli.training.checkpoint import restore
from llmcli.training.counters import TrainState
from llmcli.training.distributed import DistInfo
from llmcli.training.loop import train
from llmcli.training.memory import check_memory
from llmcli.training.optim import build_optimizer
from llmcli.training.precision import Precision
from llmcli.training.state import ResumeState
from llmcli.training.step import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

# Derandomized: every run, CI's included, tries the same examples, so a failure is reproducible
# rather than luck; set derandomize=False locally to explore new ones.
FUZZ = settings(
    max_examples=50,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
TEXT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me!\n"
MODEL = {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 16}

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0, 1, -1, 2**31, 1e308, -1e308, 5e-324, "", "2", "gelu", "default"])
    | st.text(max_size=12)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def replaced(document: dict[str, Any], path: tuple, value: Any) -> dict[str, Any]:
    """A deep copy of `document` with the field at `path` (keys and indexes) set to `value`."""
    out = copy.deepcopy(document)
    holder = out
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    return out


def fields(document: Any, prefix: tuple = (), depth: int = 3) -> list[tuple]:
    """The paths of every field of `document` down to `depth` (mappings and short lists)."""
    if depth == 0:
        return []
    items = (
        document.items()
        if isinstance(document, dict)
        else enumerate(document[:3])
        if isinstance(document, list)
        else []
    )
    paths = []
    for key, value in items:
        paths.append((*prefix, key))
        paths += fields(value, (*prefix, key), depth - 1)
    return paths


# --- meta.json and metrics.jsonl: informative, so always shown ----------------------------------


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("informative")
    records = [
        {"kind": "train", "step": 1, "tokens": 64, "elapsed_s": 0.5, "train_loss": 4.0, "lr": 0.1},
        {
            "kind": "eval",
            "step": 2,
            "tokens": 128,
            "elapsed_s": 1.0,
            "train_loss": 3.6,
            "val_loss": 3.5,
        },
    ]
    meta = {"tokens": 128, "elapsed_s": 1.0, "best_val_loss": 3.5, "best_step": 2, "step": 2}
    runs = []
    for name in ("a", "b"):
        run = save_tiny_run(
            root / name, CharTokenizer.train([TEXT]), {"model": MODEL}, extra_meta=meta
        )
        (run / METRICS_FILE).write_text("\n".join(map(json.dumps, records)) + "\n")
        runs.append(run)
    return runs[0], runs[1]


META_KEYS = [
    "step", "tokens", "max_steps", "vocab_size", "n_params", "world_size", "elapsed_s",
    "best_val_loss", "best_step", "device", "dtype", "last_eval", "versions",
]  # fmt: skip


@FUZZ
@given(key=st.sampled_from(META_KEYS), value=JSON)
def test_meta_json_any_value_in_any_field_is_shown_or_left_out(two_runs, key, value) -> None:
    run, other = two_runs
    meta = json.loads((run / META_FILE).read_text())
    (run / META_FILE).write_text(json.dumps({**meta, key: value}))
    comparison = compare_runs([str(run), str(other)])
    format_table(comparison)
    json.dumps(comparison.to_dict())
    summary = comparison.runs[0]
    if key == "tokens" and not (type(value) is int and value >= 0):
        assert summary.tokens == 128  # left out: the metrics' own figure is shown
    format_info(run_info(run))
    (run / META_FILE).write_text(json.dumps(meta))


@settings(FUZZ, max_examples=15)  # each example draws a picture
@given(
    record=st.integers(0, 1),
    key=st.sampled_from(["kind", "step", *NUMBER_FIELDS]),
    value=JSON,
    whole=st.booleans(),
)
def test_metrics_jsonl_any_value_in_any_field_reads_as_typed_records(
    two_runs, record, key, value, whole
) -> None:
    run, other = two_runs
    original = (run / METRICS_FILE).read_text()
    records = [json.loads(line) for line in original.splitlines()]
    records[record] = value if whole else {**records[record], key: value}
    (run / METRICS_FILE).write_text("\n".join(map(json.dumps, records)) + "\n")
    for r in read_metrics(run / METRICS_FILE):
        assert type(r["step"]) is int and r["step"] >= 0
        assert all(
            isinstance(r[k], (int, float)) and not isinstance(r[k], bool)
            for k in NUMBER_FIELDS
            if k in r
        )
    try:
        format_table(compare_runs([str(run), str(other)]))
    except InputError as exc:
        assert "is not in the metrics.jsonl of" in str(exc)
    plot_losses(run / METRICS_FILE, run.parent / "loss.png")
    (run / METRICS_FILE).write_text(original)


# --- a run's config.yaml -------------------------------------------------------------------------


@FUZZ
@given(data=st.data(), value=JSON)
def test_config_yaml_any_value_in_any_field_is_a_valid_config_or_bad_input(
    two_runs, data, value
) -> None:
    run, _ = two_runs
    original = (run / CONFIG_FILE).read_text()
    raw = yaml.safe_load(original)
    path = data.draw(st.sampled_from(fields(raw, depth=2)))
    (run / CONFIG_FILE).write_text(yaml.safe_dump(replaced(raw, path, value)))
    try:
        load_config_file(run)
    except InputError as exc:
        assert str(run / CONFIG_FILE) in str(exc)
    (run / CONFIG_FILE).write_text(original)


# --- tokenizer.json -----------------------------------------------------------------------------

CHARS = sorted(set(TEXT))


def use_tokenizer(text: str, source: str) -> None:
    """Read a tokenizer file's text, then encode and decode with what it gives."""
    try:
        tok = tokenizer_from_json(text, source)
    except InputError as exc:
        assert source in str(exc)
        return
    for sample in ("ROMEO", "J\n", "<|endoftext|>", "zq"):
        try:
            ids = tok.encode(sample)
            assert tok.encode_batch([sample, sample]) == [ids, ids]
        except InputError:
            continue
        tok.decode(ids)


@FUZZ
@given(key=st.sampled_from(["kind", "version", "chars", "eot", "other"]), value=JSON)
def test_old_char_tokenizer_any_value_in_any_field_loads_or_is_bad_input(key, value) -> None:
    old = {"kind": "llmcli-char", "version": 2, "chars": CHARS, "eot": "<|endoftext|>"}
    use_tokenizer(json.dumps({**old, key: value}), "'old.json'")


@FUZZ
@given(data=st.data(), value=JSON)
def test_hugging_face_tokenizer_any_value_in_any_field_loads_or_is_bad_input(data, value) -> None:
    valid = json.loads(CharTokenizer(CHARS).to_json())
    path = data.draw(st.sampled_from(fields(valid)))
    use_tokenizer(json.dumps(replaced(valid, path, value)), "'tokenizer.json'")


# --- a Hugging Face config.json -------------------------------------------------------------------

# The keys the architectures read, beside those an export writes.
HF_KEYS = [
    "model_type", "vocab_size", "n_embd", "n_head", "n_layer", "n_positions", "n_ctx",
    "hidden_size", "num_attention_heads", "num_hidden_layers", "max_position_embeddings",
    "n_inner", "intermediate_size", "activation_function", "hidden_act", "layer_norm_epsilon",
    "layer_norm_eps", "rms_norm_eps", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
    "add_cross_attention", "use_parallel_residual", "tie_word_embeddings", "rope_theta",
    "rotary_emb_base", "rotary_pct", "rope_scaling", "rope_parameters", "num_key_value_heads",
    "head_dim", "attention_bias", "mlp_bias",
]  # fmt: skip


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for fmt, opts in (
        ("gpt2", {}),
        ("gpt-neox", {"pos_emb": "rope"}),
        ("arcee", {"pos_emb": "rope", "norm": "rmsnorm"}),
    ):
        export_hf(make_run(root / f"run-{fmt}", "char", **opts), root / fmt, fmt=fmt)
        out[fmt] = root / fmt
    return out


@FUZZ
@given(fmt=st.sampled_from(["gpt2", "gpt-neox", "arcee"]), data=st.data(), value=JSON)
def test_hf_config_json_any_value_in_any_field_is_a_model_or_bad_input(exports, fmt, data, value):
    folder = exports[fmt]
    original = (folder / "config.json").read_text()
    valid = json.loads(original)
    path = data.draw(st.sampled_from(sorted({(k,) for k in HF_KEYS} | set(fields(valid, depth=2)))))
    document = replaced(valid, path, value) if path[0] in valid or len(path) == 1 else valid
    (folder / "config.json").write_text(json.dumps(document))
    try:
        resolved = resolve_init_from(Config(train=TrainConfig(init_from=str(folder))))
        check_memory(resolved, 40, torch.device("cpu"), "float32")  # what train checks next
    except InputError as exc:
        assert str(folder / "config.json") in str(exc) or "model." in str(exc), exc
    finally:
        (folder / "config.json").write_text(original)


# --- state.pt -----------------------------------------------------------------------------------

TENSORS = st.sampled_from(
    [
        torch.zeros(0),
        torch.zeros(3, dtype=torch.uint8),
        torch.zeros(16),
        torch.zeros(16, 16),
        torch.ones(2, 2, dtype=torch.int64),
        torch.tensor(1.0),
        torch.Generator().get_state(),
    ]
)


@pytest.fixture(scope="module")
def resumable(small_corpus) -> dict[str, Any]:
    """A run trained 2 steps with a save, its state.pt as a dict, and the parts of a run to
    restore it into (`restore`'s arguments after the save)."""
    raw = small_run_config(small_corpus, max_steps=2, eval_interval=2, eval_steps=1)
    config = config_from_dict(raw)
    run_dir = small_corpus.parent / "resumable"
    train(config, out_dir=run_dir, progress=False)
    vocab = ResumeState.load(run_dir).vocab_size
    model = Transformer(config.model, vocab)
    device = torch.device("cpu")
    tokens = np.arange(200, dtype=np.int64) % vocab
    trainer = Trainer(
        model=model,
        params=list(model.parameters()),
        optimizer=build_optimizer(model, config.train, "cpu"),
        precision=Precision.resolve(device, "float32"),
        batches=BatchSampler(tokens, 4, 16, seed=0),
        grad_accum=1,
        grad_clip=1.0,
    )
    parts = {"state": TrainState(), "model": model, "trainer": trainer, "guard": None}
    saved = torch.load(run_dir / STATE_FILE, weights_only=True)
    return {"config": config, "run_dir": run_dir, "vocab": vocab, "parts": parts, "saved": saved}


@FUZZ
@given(data=st.data(), value=JSON | TENSORS)
def test_state_pt_any_value_in_any_field_restores_or_is_refused(resumable, data, value) -> None:
    saved = resumable["saved"]
    skip = ("model", "optimizer")  # their many tensors: one of each is enough
    paths = [p for p in fields(saved, depth=4) if p[0] not in skip or len(p) <= 3]
    path = data.draw(st.sampled_from(paths))
    state_file = resumable["run_dir"] / STATE_FILE
    rngs = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        state = ResumeState.from_dict(replaced(saved, path, value), state_file)
        state.check_fits(resumable["config"], resumable["run_dir"], resumable["vocab"])
        restore(state, **resumable["parts"], info=DistInfo())
    except InputError as exc:  # names state.pt, or the run it cannot resume
        assert str(resumable["run_dir"]) in str(exc), exc
    finally:
        torch.set_rng_state(rngs[0])
        np.random.set_state(rngs[1])
        random.setstate(rngs[2])


def test_a_save_without_loss_scaling_resumes_under_fp16(resumable) -> None:
    """An fp32 (or bf16) save holds an empty scaler state; resuming it where fp16 scales the loss
    starts the scaler afresh instead of refusing the save as damaged."""
    saved = resumable["saved"]
    assert saved["scaler"] == {}
    parts = resumable["parts"]
    trainer = parts["trainer"]
    cpu = torch.device("cpu")
    fp32 = trainer.precision
    trainer.precision = Precision("float16", cpu, None, torch.amp.GradScaler("cpu"))
    rngs = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        restore(
            ResumeState.from_dict(saved, resumable["run_dir"] / STATE_FILE),
            **parts,
            info=DistInfo(),
        )
        assert trainer.precision.scaler.get_scale() == 2.0**16  # torch's fresh initial scale
    finally:
        trainer.precision = fp32
        torch.set_rng_state(rngs[0])
        np.random.set_state(rngs[1])
        random.setstate(rngs[2])


# --- safetensors weights ------------------------------------------------------------------------


def with_header(data: bytes, header: dict[str, Any]) -> bytes:
    """`data` (a safetensors file) with its JSON header replaced by `header`."""
    (n,) = struct.unpack("<Q", data[:8])
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


@FUZZ
@given(data=st.data(), value=JSON)
def test_weights_any_value_in_any_header_field_loads_or_is_refused(two_runs, data, value) -> None:
    run, _ = two_runs
    weights = (run / MODEL_FILE).read_bytes()
    (n,) = struct.unpack("<Q", weights[:8])
    header = json.loads(weights[8 : 8 + n])
    path = data.draw(st.sampled_from(fields(header, depth=3)))
    damaged = run.parent / "damaged.safetensors"
    damaged.write_bytes(with_header(weights, replaced(header, path, value)))
    model = Transformer(
        config_from_dict({"model": MODEL}).model, CharTokenizer.train([TEXT]).vocab_size
    )
    try:
        tensors, _ = read_weights(damaged)
        load_weights(model, tensors, damaged)
    except InputError as exc:
        assert str(damaged) in str(exc), exc
