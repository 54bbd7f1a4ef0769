"""Tests for llmcli.attention.report: head metrics on hand-built patterns, dumps, capture, the command."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from llmcli.attention import report as ins
from llmcli.errors import InputError

T = 8


# ------------------------------------------------------------------ hand-built attention patterns


def uniform(T: int) -> np.ndarray:
    """Each query spreads evenly over keys 0..q."""
    a = np.tril(np.ones((T, T)))
    return a / a.sum(-1, keepdims=True)


def previous(T: int) -> np.ndarray:
    """Each query q >= 1 attends to q - 1 only (query 0 to itself)."""
    a = np.zeros((T, T))
    a[0, 0] = 1.0
    a[np.arange(1, T), np.arange(T - 1)] = 1.0
    return a


def identity(T: int) -> np.ndarray:
    return np.eye(T)


def sink(T: int) -> np.ndarray:
    a = np.zeros((T, T))
    a[:, 0] = 1.0
    return a


def half_prev_half_self(T: int) -> np.ndarray:
    a = np.zeros((T, T))
    a[0, 0] = 1.0
    for q in range(1, T):
        a[q, q - 1] = a[q, q] = 0.5
    return a


def test_uniform_pattern_scores() -> None:
    qs = np.arange(1, T)
    m = ins.head_metrics(uniform(T))
    np.testing.assert_allclose(m[0], 1.0)  # maximal entropy everywhere
    np.testing.assert_allclose(m[1], np.mean(1 / (qs + 1)))
    np.testing.assert_allclose(m[2], np.mean(1 / (qs + 1)))
    np.testing.assert_allclose(m[3], np.mean(qs / 2))  # sum_k (q-k)/(q+1) = q/2


def test_previous_token_pattern_scores() -> None:
    m = ins.head_metrics(previous(T))
    np.testing.assert_allclose(m, [0.0, 1.0, 1 / (T - 1), 1.0], atol=1e-12)


def test_identity_pattern_scores() -> None:
    np.testing.assert_allclose(ins.head_metrics(identity(T)), [0.0, 0.0, 0.0, 0.0], atol=1e-12)


def test_sink_pattern_scores() -> None:
    # Query 0 is excluded, so the sink score is exactly 1 and the distance the mean of 1..T-1.
    m = ins.head_metrics(sink(T))
    np.testing.assert_allclose(m, [0.0, 1 / (T - 1), 1.0, T / 2], atol=1e-12)


def test_mixed_pattern_entropy_against_loop() -> None:
    a = half_prev_half_self(T)
    expected = sum(math.log(2) / math.log(q + 1) for q in range(1, T)) / (T - 1)
    assert ins.entropy_score(a) == pytest.approx(expected)
    assert ins.prev_token_score(a) == pytest.approx(0.5)
    assert ins.mean_distance(a) == pytest.approx(0.5)


def test_random_rows_against_plain_formulas() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, T, T))
    logits[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] = -np.inf
    a = np.exp(logits - logits.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    m = ins.head_metrics(a)
    assert m.shape == (2, 3, len(ins.METRIC_NAMES))
    for i in range(2):
        for j in range(3):
            p = a[i, j]
            ent = np.mean(
                [
                    -sum(p[q, k] * math.log(p[q, k]) for k in range(q + 1)) / math.log(q + 1)
                    for q in range(1, T)
                ]
            )
            prev = np.mean([p[q, q - 1] for q in range(1, T)])
            first = np.mean([p[q, 0] for q in range(1, T)])
            dist = np.mean([sum(p[q, k] * (q - k) for k in range(q + 1)) for q in range(1, T)])
            np.testing.assert_allclose(m[i, j], [ent, prev, first, dist], rtol=1e-10)


def test_single_token_scores_nan() -> None:
    assert np.isnan(ins.head_metrics(np.ones((1, 1)))).all()


def induction_pattern(period: int) -> np.ndarray:
    """Second-copy queries attend to the token after the earlier occurrence; others to self."""
    a = np.eye(2 * period)
    for q in range(period, 2 * period):
        a[q, q] = 0.0
        a[q, q - period + 1] = 1.0
    return a


def test_induction_score_patterns() -> None:
    p = 5
    assert ins.induction_score(induction_pattern(p), p) == pytest.approx(1.0)
    assert ins.induction_score(previous(2 * p), p) == pytest.approx(0.0)
    assert ins.induction_score(uniform(2 * p), p) == pytest.approx(
        np.mean([1 / (q + 1) for q in range(p, 2 * p)])
    )
    # A "duplicate token" head attends to the earlier occurrence itself, not the one after it.
    dup = np.eye(2 * p)
    for q in range(p, 2 * p):
        dup[q, q], dup[q, q - p] = 0.0, 1.0
    assert ins.induction_score(dup, p) == pytest.approx(0.0)
    # Half of the second copy does it: score 1/2.
    half = induction_pattern(4)
    half[4:6] = np.eye(8)[4:6]
    assert ins.induction_score(half, 4) == pytest.approx(0.5)


def test_repeated_random_tokens() -> None:
    g = torch.Generator().manual_seed(3)
    x = ins.repeated_random_tokens(vocab_size=20, period=6, batch=4, generator=g)
    assert x.shape == (4, 12)
    assert torch.equal(x[:, :6], x[:, 6:])
    assert all(len(set(row[:6].tolist())) == 6 for row in x)  # distinct within a copy
    y = ins.repeated_random_tokens(20, 6, 4, torch.Generator().manual_seed(3))
    assert torch.equal(x, y)


# ------------------------------------------------------------------ dumps


def make_dump(T: int = 6, L: int = 2, H: int = 3) -> ins.AttentionDump:
    rng = np.random.default_rng(1)
    attn = rng.random((L, H, T, T)) * np.tril(np.ones((T, T)))  # (L, H, T, T), causal
    attn /= attn.sum(-1, keepdims=True)
    tokens = ["<", "/script>", " ", "\n", "é", "&"][:T]
    metrics = ins.head_metrics(attn).astype(np.float32)
    return ins.AttentionDump(
        attn=attn.astype(np.float32),
        tokens=tokens,
        token_ids=np.arange(T),
        metrics=metrics,
        metric_names=list(ins.METRIC_NAMES),
        layers=[0, 2],
        heads=[0, 1, 3][:H],
        meta={"prompt": "".join(tokens), "checkpoint": "/x"},
    )


@pytest.mark.parametrize("fmt", ["npz", "safetensors", "json"])
def test_dump_round_trip(tmp_path, fmt: str) -> None:
    dump = make_dump()
    path = ins.save_dump(dump, tmp_path / f"attention{ins.FORMATS[fmt]}", fmt)
    back = ins.load_dump(path)
    np.testing.assert_array_equal(back.attn, dump.attn)
    np.testing.assert_array_equal(back.metrics, dump.metrics)
    np.testing.assert_array_equal(back.token_ids, dump.token_ids)
    assert back.tokens == dump.tokens
    assert back.metric_names == dump.metric_names
    assert (back.layers, back.heads) == (dump.layers, dump.heads)
    assert back.meta == dump.meta
    assert back.attn.dtype == np.float32
    assert not list(tmp_path.glob(".*tmp"))  # no temp file left behind


def test_npz_loads_without_pickle(tmp_path) -> None:
    dump = make_dump()
    path = ins.save_dump(dump, tmp_path / "attention.npz")
    with np.load(path, allow_pickle=False) as z:
        assert set(z.files) >= {"attn", "tokens", "token_ids", "metrics", "metric_names", "meta"}
        assert z["attn"].dtype == np.float32 and z["attn"].shape == (2, 3, 6, 6)
        assert list(z["tokens"]) == dump.tokens
        assert z["metrics"].shape == (2, 3, 4)
        assert json.loads(str(z["meta"]))["checkpoint"] == "/x"


def test_json_dump_writes_nan_as_null(tmp_path) -> None:
    dump = make_dump(T=1)
    path = ins.save_dump(dump, tmp_path / "attention.json", "json")
    obj = json.loads(path.read_text())
    assert obj["metrics"][0][0] == [None] * 4
    assert np.isnan(ins.load_dump(path).metrics).all()


def test_metrics_table() -> None:
    dump = make_dump()
    lines = ins.format_metrics_table(dump).splitlines()
    assert lines[0].split() == ["layer", "head", *ins.METRIC_NAMES]
    assert len(lines) == 1 + 2 * 3
    assert lines[-1].split()[:2] == ["2", "3"]
    assert float(lines[-1].split()[2]) == pytest.approx(float(dump.metrics[1, 2, 0]), abs=1e-3)


def test_select_indices() -> None:
    assert ins.select_indices(None, 4, "head") == [0, 1, 2, 3]
    assert ins.select_indices([3, 1, 3], 4, "head") == [1, 3]
    with pytest.raises(InputError, match=r"--head 4 is out of range.*4 heads, numbered 0 to 3"):
        ins.select_indices([4], 4, "head")
    with pytest.raises(InputError, match="--layer -1"):
        ins.select_indices([-1], 2, "layer")


def test_plot_layers_writes_one_png_per_layer(tmp_path) -> None:
    dump = make_dump()
    paths = ins.plot_layers(dump, tmp_path)
    assert [p.name for p in paths] == ["layer-0.png", "layer-2.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_label_thinning() -> None:
    assert ins.label_step(20) == 1
    assert ins.label_step(64) == 2
    assert ins.label_step(256) == 8
    assert ins.token_label(" \n") == "␣↵"


# ------------------------------------------------------------------ a real model and run

CORPUS = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved.\n"
) * 3
CTX = 16


def build_model(seed: int = 0, **model_overrides):
    """A small Transformer with sharpened query/key weights, so heads differ visibly."""
    from llmcli.config import config_from_dict
    from llmcli.model import Transformer
    from llmcli.tokenizer import CharTokenizer

    tok = CharTokenizer.train([CORPUS])
    model_cfg = {"n_layer": 2, "n_head": 4, "n_embed": 32, "context_length": CTX, **model_overrides}
    config = config_from_dict({"model": model_cfg, "data": {"val_fraction": 0.25}})
    gen = torch.Generator().manual_seed(seed)
    model = Transformer.from_config(config.model, tok.vocab_size, generator=gen)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.normal_(0.0, 0.4, generator=gen)
    model.eval()
    return config, tok, model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from llmcli.checkpoint import save_model_run

    root = tmp_path_factory.mktemp("inspect")
    corpus = root / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    config, tok, model = build_model()
    config.data.path = str(corpus)
    config.data.cache_dir = str(root / "cache")
    save_model_run(root / "checkpoints" / "tiny", config, tok, model)
    return root / "checkpoints" / "tiny"


@pytest.fixture(scope="module")
def loaded(run_dir):
    from llmcli.checkpoint import load_run

    return load_run(run_dir)


def test_captured_logits_equal_normal_forward() -> None:
    _, tok, model = build_model(dropout=0.3)
    idx = torch.tensor([tok.encode("Speak, speak. You")[:CTX]])
    model.train()  # capture must switch dropout off by itself, and restore the mode
    logits, attn = ins.capture_attention(model, idx)
    assert model.training
    model.eval()
    with torch.no_grad():
        expected, _ = model(idx)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert attn.shape == (1, 2, 4, idx.shape[1], idx.shape[1])


def test_weights_equal_torch_multihead_attention() -> None:
    """Every layer's per-head weights equal nn.MultiheadAttention's on that layer's input."""
    _, tok, model = build_model()
    idx = torch.tensor([tok.encode("Before we procee"), tok.encode("You are all reso")])
    inputs = []
    hooks = [
        block.attn.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
        for block in model.blocks
    ]
    _, attn = ins.capture_attention(model, idx)  # (B, L, H, T, T)
    for h in hooks:
        h.remove()
    T = idx.shape[1]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)  # True = not allowed
    for layer, (block, x) in enumerate(zip(model.blocks, inputs, strict=True)):
        mha = torch.nn.MultiheadAttention(32, 4, bias=True, batch_first=True)
        with torch.no_grad():
            mha.in_proj_weight.copy_(block.attn.qkv.weight)
            mha.in_proj_bias.copy_(block.attn.qkv.bias)
            mha.out_proj.weight.copy_(block.attn.proj.weight)
            mha.out_proj.bias.copy_(block.attn.proj.bias)
        mha.eval()
        with torch.no_grad():
            _, per_head = mha(
                x, x, x, attn_mask=future, need_weights=True, average_attn_weights=False
            )  # (B, H, T, T)
            _, averaged = mha(
                x, x, x, attn_mask=future, need_weights=True, average_attn_weights=True
            )  # (B, T, T)
        torch.testing.assert_close(attn[:, layer], per_head, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(attn[:, layer].mean(1), averaged, rtol=1e-5, atol=1e-6)
        # The heads really differ: the average hides something.
        assert (attn[:, layer] - attn[:, layer].mean(1, keepdim=True)).abs().max() > 0.05


def test_dump_from_run(loaded, tmp_path) -> None:
    prompt = "You are all resolved"[:CTX]
    (dump,) = ins.build_dumps(loaded.model, loaded.tokenizer, [prompt])
    T = len(prompt)
    assert dump.attn.shape == (2, 4, T, T) and dump.attn.dtype == np.float32
    np.testing.assert_allclose(dump.attn.sum(-1), 1.0, atol=1e-6)
    assert (dump.attn[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0).all()
    assert dump.tokens == list(prompt)
    assert dump.token_ids.tolist() == loaded.tokenizer.encode(prompt)
    np.testing.assert_allclose(dump.metrics, ins.head_metrics(dump.attn), rtol=1e-5)
    assert dump.metric_names == list(ins.METRIC_NAMES)


def test_layer_and_head_selection(loaded) -> None:
    prompt = "Speak, speak."
    (full,) = ins.build_dumps(loaded.model, loaded.tokenizer, [prompt])
    (part,) = ins.build_dumps(loaded.model, loaded.tokenizer, [prompt], layers=[1], heads=[3, 0, 3])
    assert (part.layers, part.heads) == ([1], [0, 3])
    assert (part.meta["layers"], part.meta["heads"]) == ([1], [0, 3])
    np.testing.assert_array_equal(part.attn, full.attn[[1]][:, [0, 3]])
    np.testing.assert_array_equal(part.metrics, full.metrics[[1]][:, [0, 3]])
    with pytest.raises(InputError, match="--layer 2 is out of range"):
        ins.build_dumps(loaded.model, loaded.tokenizer, [prompt], layers=[2])
    with pytest.raises(InputError, match="--head 4 is out of range"):
        ins.build_dumps(loaded.model, loaded.tokenizer, [prompt], heads=[4])


def test_several_prompts_equal_each_alone_without_padding(loaded) -> None:
    prompts = ["All:\nSpeak", "You", "Before we procee", "a"]
    together = ins.build_dumps(loaded.model, loaded.tokenizer, prompts)
    for p, dump in zip(prompts, together, strict=True):
        (alone,) = ins.build_dumps(loaded.model, loaded.tokenizer, [p])
        assert dump.tokens == list(p) and dump.attn.shape[-1] == len(p)
        np.testing.assert_allclose(dump.attn, alone.attn, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dump.metrics, alone.metrics, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(dump.attn.sum(-1), 1.0, atol=1e-6)
    assert [d.meta["prompt_index"] for d in together] == [0, 1, 2, 3]


def test_induction_column(loaded) -> None:
    (dump,) = ins.build_dumps(loaded.model, loaded.tokenizer, ["Speak"], induction=True)
    assert dump.metric_names == [*ins.METRIC_NAMES, ins.INDUCTION]
    info = dump.meta["induction"]
    assert info["period"] == CTX // 2
    g = torch.Generator().manual_seed(info["seed"])
    idx = ins.repeated_random_tokens(
        loaded.tokenizer.vocab_size, info["period"], info["sequences"], g
    )
    _, attn = ins.capture_attention(loaded.model, idx)  # (S, L, H, 2p, 2p)
    p = info["period"]
    expected = np.mean(
        [
            [
                [
                    np.mean([attn[s, li, h, q, q - p + 1].item() for q in range(p, 2 * p)])
                    for h in range(4)
                ]
                for li in range(2)
            ]
            for s in range(len(idx))
        ],
        axis=0,
    )
    np.testing.assert_allclose(dump.metrics[..., -1], expected, rtol=1e-5)


def test_prompt_errors(loaded) -> None:
    tok, model = loaded.tokenizer, loaded.model
    long = "Before we proceed any further"
    with pytest.raises(InputError, match=r"29 tokens long.*context_length is 16.*--truncate"):
        ins.build_dumps(model, tok, [long])
    (dump,) = ins.build_dumps(model, tok, [long], truncate=True)
    assert "".join(dump.tokens) == long[-CTX:] and dump.meta["truncated"] is True
    with pytest.raises(InputError, match="empty"):
        ins.build_dumps(model, tok, [""])
    with pytest.raises(InputError, match=r"prompt #2"):
        ins.build_dumps(model, tok, ["ok", ""])
    with pytest.raises(InputError, match="vocabulary lacks"):
        ins.build_dumps(model, tok, ["Zebra~"])


def test_read_prompt_file(tmp_path) -> None:
    lines = tmp_path / "p.txt"
    lines.write_text("first\n\nsecond line\n")
    assert ins.read_prompt_file(lines) == ["first", "second line"]
    js = tmp_path / "p.json"
    js.write_text(json.dumps(["a\nb", "c"]))
    assert ins.read_prompt_file(js) == ["a\nb", "c"]
    js.write_text('{"a": 1}')
    with pytest.raises(InputError, match="list of strings"):
        ins.read_prompt_file(js)
    with pytest.raises(InputError, match="does not exist"):
        ins.read_prompt_file(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(InputError, match="no prompt"):
        ins.read_prompt_file(tmp_path / "empty.txt")


def test_default_prompt_is_the_start_of_validation_text(run_dir, tmp_path) -> None:
    result = ins.inspect_attention(run_dir, out_dir=tmp_path, pictures=False, viewer=False)
    (dump,) = result.dumps
    n_train = int(len(CORPUS) * (1 - 0.25))  # char tokenizer: one token per character
    assert "".join(dump.tokens) == CORPUS[n_train : n_train + CTX]
    assert "validation split" in result.notes[-1]
    assert dump.meta["default_prompt"] == result.notes[-1]


def test_default_prompt_falls_back_clearly(run_dir, tmp_path) -> None:
    import shutil

    from llmcli.checkpoint import load_run

    moved = tmp_path / "run"
    shutil.copytree(run_dir, moved)
    config_path = moved / "config.yaml"
    config_path.write_text(config_path.read_text().replace("corpus.txt", "gone.txt"))
    ids, note = ins.default_prompt_ids(load_run(moved))
    assert "cannot read" in note or "cannot be read" in note
    assert "gone.txt" in note and "fallback" in note
    assert ids == load_run(moved).tokenizer.encode(ins.FALLBACK_PROMPT)[:CTX]


# ------------------------------------------------------------------ the command


def cli(args: list[str], capsys) -> tuple[int, str, str]:
    from llmcli.cli import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_command_end_to_end(run_dir, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(run_dir.parent.parent)  # checkpoints/tiny is the latest run
    code, out, err = cli(["inspect-attention", "--prompt", "Speak, speak.", "--induction"], capsys)
    assert code == 0, err
    assert "checkpoint: checkpoints/tiny" in err
    table = [line.split() for line in out.splitlines()]
    assert ["layer", "head", *ins.METRIC_NAMES, "induction"] in table
    folder = run_dir / "attention"
    names = {p.name for p in folder.iterdir()}
    assert {"attention.npz", "layer-0.png", "layer-1.png", "attention.html"} <= names
    with np.load(folder / "attention.npz", allow_pickle=False) as z:
        assert z["attn"].shape == (2, 4, 13, 13)
        assert z["metrics"].shape == (2, 4, 5)
        meta = json.loads(str(z["meta"]))
    assert meta["checkpoint"] == str(run_dir.resolve())
    assert meta["weights_sha256"] == ins.sha256_file(run_dir / "best.safetensors")
    assert meta["prompt"] == "Speak, speak."
    assert meta["config"]["model"]["n_head"] == 4
    assert meta["llmcli_version"]


@pytest.mark.parametrize("fmt", ["safetensors", "json"])
def test_command_formats_hold_the_same_content(run_dir, tmp_path, capsys, fmt) -> None:
    base = [
        "inspect-attention",
        "--checkpoint",
        str(run_dir),
        "--prompt",
        "All:\nSpeak",
        "--layer",
        "1",
        "--head",
        "2",
        "--head",
        "0",
        "--no-pictures",
    ]
    assert cli([*base, "--out", str(tmp_path / "npz")], capsys)[0] == 0
    assert cli([*base, "--out", str(tmp_path / fmt), "--format", fmt], capsys)[0] == 0
    a = ins.load_dump(tmp_path / "npz" / "attention.npz")
    b = ins.load_dump(tmp_path / fmt / f"attention.{fmt}")
    np.testing.assert_array_equal(a.attn, b.attn)
    np.testing.assert_array_equal(a.metrics, b.metrics)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    assert (a.tokens, a.metric_names, a.meta) == (b.tokens, b.metric_names, b.meta)
    assert (a.layers, a.heads) == ([1], [0, 2])
    assert a.attn.shape == (1, 2, 10, 10)


def test_command_several_prompts(run_dir, tmp_path, capsys) -> None:
    pf = tmp_path / "prompts.json"
    pf.write_text(json.dumps(["You", "All:\nSpeak"]))
    code, out, err = cli(
        [
            "inspect-attention",
            "--checkpoint",
            str(run_dir),
            "--prompt",
            "Speak",
            "--prompt-file",
            str(pf),
            "--out",
            str(tmp_path / "o"),
            "--no-pictures",
        ],
        capsys,
    )
    assert code == 0, err
    for i, p in enumerate(["Speak", "You", "All:\nSpeak"]):
        dump = ins.load_dump(tmp_path / "o" / f"prompt-{i:03d}" / "attention.npz")
        assert "".join(dump.tokens) == p and dump.attn.shape[-1] == len(p)
        assert (tmp_path / "o" / f"prompt-{i:03d}" / "attention.html").is_file()
        assert not (tmp_path / "o" / f"prompt-{i:03d}" / "layer-0.png").exists()
    assert not (tmp_path / "o" / "attention.npz").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--prompt", "Before we proceed any further"],
            r"29 tokens long but the model's context_length is 16.*--truncate",
        ),
        (["--prompt", ""], "empty"),
        (["--prompt", "ok", "--layer", "5"], r"--layer 5 is out of range.*2 layers"),
        (["--prompt", "ok", "--head", "-1"], r"--head -1 is out of range.*4 heads"),
        (["--prompt", "ok", "--format", "csv"], "--format 'csv'"),
        (["--prompt", "~~~"], "vocabulary lacks"),
    ],
)
def test_command_bad_input_exits_2(run_dir, capsys, args, message) -> None:
    import re

    code, out, err = cli(["inspect-attention", "--checkpoint", str(run_dir), *args], capsys)
    assert code == 2
    assert err.startswith("checkpoint:") or err.startswith("error:")
    assert re.search(message, err.split("error: ", 1)[1].replace("\n", " ")), err
    assert "Traceback" not in err


def test_command_no_run_found(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(["inspect-attention"], capsys)
    assert code == 2
    assert "no trained run found" in err


def test_command_ctrl_c_exits_130(run_dir, capsys, monkeypatch) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ins, "inspect_attention", interrupted)
    code, _, _ = cli(["inspect-attention", "--checkpoint", str(run_dir)], capsys)
    assert code == 130
