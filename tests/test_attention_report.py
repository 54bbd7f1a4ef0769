"""Tests for llmcli.inspection.attention and the inspect-attention command: a real model and run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from attention_helpers import CORPUS, CTX, build_model, make_dump

from llmcli.errors import InputError
from llmcli.evaluation.probe import make_probe, probe_scores
from llmcli.generation import prompts
from llmcli.inspection import attention as report
from llmcli.inspection.attention import (
    FALLBACK_PROMPT,
    PROMPT_FILE,
    InspectOptions,
    InspectResult,
    build_dumps,
    default_prompt_ids,
    format_report,
    inspect_attention,
    select_indices,
    sha256_file,
)
from llmcli.inspection.capture import capture_attention
from llmcli.inspection.dump import format_metrics_table, load_dump
from llmcli.inspection.metrics import INDUCTION, METRIC_NAMES, PROBE_INDUCTION, head_metrics


def test_select_indices() -> None:
    assert select_indices(None, 4, "head") == [0, 1, 2, 3]
    assert select_indices([3, 1, 3], 4, "head") == [1, 3]
    with pytest.raises(InputError, match=r"--head 4 is out of range.*4 heads, numbered 0 to 3"):
        select_indices([4], 4, "head")
    with pytest.raises(InputError, match="--layer -1"):
        select_indices([-1], 2, "layer")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from llmcli.runs.directory import save_model_run

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
    from llmcli.runs.loading import load_run

    return load_run(run_dir)


def test_dump_from_run(loaded, tmp_path) -> None:
    prompt = "You are all resolved"[:CTX]
    (dump,) = build_dumps(loaded.model, loaded.tokenizer, [prompt])
    T = len(prompt)
    assert dump.attn.shape == (2, 4, T, T) and dump.attn.dtype == np.float32
    np.testing.assert_allclose(dump.attn.sum(-1), 1.0, atol=1e-6)
    assert (dump.attn[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0).all()
    assert dump.tokens == list(prompt)
    assert dump.token_ids.tolist() == loaded.tokenizer.encode(prompt)
    np.testing.assert_allclose(dump.metrics, head_metrics(dump.attn), rtol=1e-5)
    assert dump.metric_names == list(METRIC_NAMES)


def test_layer_and_head_selection(loaded) -> None:
    prompt = "Speak, speak."
    (full,) = build_dumps(loaded.model, loaded.tokenizer, [prompt])
    (part,) = build_dumps(
        loaded.model, loaded.tokenizer, [prompt], InspectOptions(layers=[1], heads=[3, 0, 3])
    )
    assert (part.layers, part.heads) == ([1], [0, 3])
    assert (part.meta["layers"], part.meta["heads"]) == ([1], [0, 3])
    np.testing.assert_array_equal(part.attn, full.attn[[1]][:, [0, 3]])
    np.testing.assert_array_equal(part.metrics, full.metrics[[1]][:, [0, 3]])
    with pytest.raises(InputError, match="--layer 2 is out of range"):
        build_dumps(loaded.model, loaded.tokenizer, [prompt], InspectOptions(layers=[2]))
    with pytest.raises(InputError, match="--head 4 is out of range"):
        build_dumps(loaded.model, loaded.tokenizer, [prompt], InspectOptions(heads=[4]))


def test_several_prompts_equal_each_alone_without_padding(loaded) -> None:
    prompts = ["All:\nSpeak", "You", "Before we procee", "a"]
    together = build_dumps(loaded.model, loaded.tokenizer, prompts)
    for p, dump in zip(prompts, together, strict=True):
        (alone,) = build_dumps(loaded.model, loaded.tokenizer, [p])
        assert dump.tokens == list(p) and dump.attn.shape[-1] == len(p)
        np.testing.assert_allclose(dump.attn, alone.attn, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dump.metrics, alone.metrics, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(dump.attn.sum(-1), 1.0, atol=1e-6)
    assert [d.meta["prompt_index"] for d in together] == [0, 1, 2, 3]


def test_induction_columns_score_the_prompt_and_the_labelled_probe(loaded, tmp_path) -> None:
    prompts = ["Speak, speak.", "Spk,"]  # the second repeats no token
    options = InspectOptions(induction=True)
    dumps = build_dumps(loaded.model, loaded.tokenizer, prompts, options)
    probe = make_probe(loaded.tokenizer, CTX)
    on_probe = probe_scores(loaded.model, probe).induction  # (L, H)
    for dump, text in zip(dumps, prompts, strict=True):
        assert dump.metric_names == [*METRIC_NAMES, INDUCTION, PROBE_INDUCTION]
        assert dump.meta["probe"] == probe.describe()
        np.testing.assert_allclose(dump.metrics[..., -1], on_probe, rtol=1e-5)  # every prompt
        # The prompt's own: each query whose token occurred before, its weight on the tokens
        # after those occurrences, averaged (by hand, from a plain capture).
        ids = loaded.tokenizer.encode(text)
        _, attn = capture_attention(loaded.model, torch.tensor([ids]))  # (1, L, H, T, T)
        queries = [q for q in range(len(ids)) if ids[q] in ids[:q]]
        assert dump.meta["induction_queries"] == len(queries)
        expected = np.full((2, 4), np.nan)
        for layer, head in np.ndindex(2, 4):
            weights = [
                sum(attn[0, layer, head, q, k + 1].item() for k in range(q) if ids[k] == ids[q])
                for q in queries
            ]
            expected[layer, head] = np.mean(weights) if weights else np.nan
        np.testing.assert_allclose(dump.metrics[..., -2], expected, rtol=1e-5)
    assert len(queries) == 0 and np.isnan(dumps[1].metrics[..., -2]).all()
    folders = [tmp_path / "a", tmp_path / "b"]
    text = format_report(InspectResult(tmp_path, dumps, folders, [[], []]))
    assert "induction: on this prompt's own repeats (4 of its 13 tokens occurred before" in text
    assert "- : no token of this prompt occurred before in it" in text
    assert (
        "probe_induction: on a fixed probe, the same for every prompt: 8 sequences of "
        f"{probe.period} random tokens, each repeated once (seed 0, no whitespace or special "
        "tokens)"
    ) in text


def test_prompt_errors(loaded) -> None:
    tok, model = loaded.tokenizer, loaded.model
    long = "Before we proceed any further"
    with pytest.raises(InputError, match=r"29 tokens long.*context_length is 16.*--truncate"):
        build_dumps(model, tok, [long])
    (dump,) = build_dumps(model, tok, [long], InspectOptions(truncate=True))
    assert "".join(dump.tokens) == long[-CTX:] and dump.meta["truncated"] is True
    with pytest.raises(InputError, match="empty"):
        build_dumps(model, tok, [""])
    with pytest.raises(InputError, match=r"prompt #2"):
        build_dumps(model, tok, ["ok", ""])
    with pytest.raises(InputError, match="vocabulary lacks"):
        build_dumps(model, tok, ["Zebra~"])


def test_read_prompt_file(tmp_path) -> None:
    def read_prompt_file(path):
        return prompts.read_prompt_file(path, **PROMPT_FILE)

    lines = tmp_path / "p.txt"
    lines.write_text("first\n\nsecond line\n")
    assert read_prompt_file(lines) == ["first", "second line"]
    js = tmp_path / "p.json"
    js.write_text(json.dumps(["a\nb", "c"]))
    assert read_prompt_file(js) == ["a\nb", "c"]
    js.write_text('{"a": 1}')
    with pytest.raises(InputError, match="list of strings"):
        read_prompt_file(js)
    with pytest.raises(InputError, match="does not exist"):
        read_prompt_file(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(InputError, match="no prompt"):
        read_prompt_file(tmp_path / "empty.txt")


def test_default_prompt_is_the_start_of_validation_text(run_dir, tmp_path) -> None:
    notes: list[str] = []
    options = InspectOptions(pictures=False, viewer=False)
    result = inspect_attention(run_dir, options=options, out_dir=tmp_path, notify=notes.append)
    (dump,) = result.dumps
    n_train = int(len(CORPUS) * (1 - 0.25))  # char tokenizer: one token per character
    assert "".join(dump.tokens) == CORPUS[n_train : n_train + CTX]
    assert "validation split" in notes[-1]
    assert dump.meta["default_prompt"] == notes[-1]


def test_default_prompt_falls_back_clearly(run_dir, tmp_path) -> None:
    import shutil

    from llmcli.runs.loading import load_run

    moved = tmp_path / "run"
    shutil.copytree(run_dir, moved)
    config_path = moved / "config.yaml"
    config_path.write_text(config_path.read_text().replace("corpus.txt", "gone.txt"))
    ids, note = default_prompt_ids(load_run(moved))
    assert "cannot read" in note or "cannot be read" in note
    assert "gone.txt" in note and "fallback" in note
    assert ids == load_run(moved).tokenizer.encode(FALLBACK_PROMPT)[:CTX]


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
    assert err.count("checkpoints/tiny") == 1  # named once, by the notice of the latest run
    assert "using the latest text run: checkpoints/tiny" in err
    table = [line.split() for line in out.splitlines()]
    assert ["layer", "head", *METRIC_NAMES, "induction", "probe_induction"] in table
    assert "probe_induction: on a fixed probe, the same for every prompt" in out
    folder = run_dir / "attention"
    names = {p.name for p in folder.iterdir()}
    assert {"attention.npz", "layer-0.png", "layer-1.png", "attention.html"} <= names
    with np.load(folder / "attention.npz", allow_pickle=False) as z:
        assert z["attn"].shape == (2, 4, 13, 13)
        assert z["metrics"].shape == (2, 4, 6)
        meta = json.loads(str(z["meta"]))
    assert meta["checkpoint"] == str(run_dir.resolve())
    assert meta["weights_sha256"] == sha256_file(run_dir / "best.safetensors")
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
    a = load_dump(tmp_path / "npz" / "attention.npz")
    b = load_dump(tmp_path / fmt / f"attention.{fmt}")
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
        dump = load_dump(tmp_path / "o" / f"prompt-{i:03d}" / "attention.npz")
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
        (["--ablation", "foo"], "--ablation 'foo' is not known: choose zero or mean or both"),
        (["--ablation", "zero", "--ablation-steps", "0"], r"--ablation-steps \(0\) must be"),
        (["--prompt", "ok", "--ablation-steps", "1"], "--ablation-steps .*give --ablation too"),
        (["--prompt", "ok", "--ablation", "--data", "/no/such.txt"], "--data .*does not exist"),
    ],
)
def test_command_bad_input_exits_2(run_dir, capsys, args, message) -> None:
    import re

    code, out, err = cli(["inspect-attention", "--checkpoint", str(run_dir), *args], capsys)
    assert code == 2
    assert err.startswith("checkpoint:") or err.startswith("error:")
    assert re.search(message, err.split("error: ", 1)[1].replace("\n", " ")), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("options", "argv", "message"),
    [
        (
            {"fmt": "csv"},
            ["--format", "csv"],
            "--format 'csv' is not known: choose one of npz, safetensors, json.",
        ),
        (
            {"ablation": "foo"},
            ["--ablation", "foo"],
            "--ablation 'foo' is not known: choose zero or mean or both",
        ),
        (
            {"ablation": "zero", "ablation_steps": 0},
            ["--ablation", "zero", "--ablation-steps", "0"],
            r"--ablation-steps \(0\) must be",
        ),
        (
            {"ablation_steps": 1},
            ["--ablation-steps", "1"],
            "--ablation-steps .*give --ablation too",
        ),
        (
            {"ablation_data": "x.txt"},
            ["--data", "x.txt"],
            "--data PATH is the text --ablation measures the heads on: give --ablation too",
        ),
    ],
)
def test_options_are_checked_as_they_are_made_before_a_run_loads(
    tmp_path, capsys, options, argv, message
) -> None:
    import re

    with pytest.raises(InputError, match=message):
        InspectOptions(**options)
    # The command makes its options first: no run is looked for (there is none here).
    code, _, err = cli(["inspect-attention", "--checkpoint", str(tmp_path / "none"), *argv], capsys)
    assert code == 2 and err.startswith("error: ")
    assert re.search(message, err.replace("\n", " ")), err


def test_command_no_run_found(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(["inspect-attention"], capsys)
    assert code == 2
    assert "no trained run found" in err


def test_command_ctrl_c_exits_130(run_dir, capsys, monkeypatch) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "inspect_attention", interrupted)
    code, _, _ = cli(["inspect-attention", "--checkpoint", str(run_dir)], capsys)
    assert code == 130


def test_format_report_one_block_per_prompt(tmp_path) -> None:
    long, short = make_dump(), make_dump(T=2)
    long.meta.update(prompt="x" * 70, truncated=True)
    short.meta.update(prompt="ab", truncated=False)
    result = InspectResult(
        run_dir=tmp_path,
        dumps=[long, short],
        out_dirs=[tmp_path / "prompt-000", tmp_path / "prompt-001"],
        files=[[tmp_path / "prompt-000" / "attention.npz"], [tmp_path / "prompt-001" / "a.json"]],
    )
    text = format_report(result)
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and len(blocks) == 3  # each block ends in a blank line
    assert blocks[0].splitlines()[0] == (
        f"prompt 0 (6 tokens, truncated to the last tokens): {'x' * 57 + '...'!r}"
    )
    assert blocks[1].splitlines()[0] == "prompt 1 (2 tokens): 'ab'"
    assert format_metrics_table(short) in blocks[1]
    assert blocks[1].splitlines()[-1] == f"wrote {tmp_path / 'prompt-001'}/: a.json"


# ------------------------------------------------------------------ --ablation


def reference_deltas(run_dir, steps: int):
    """Every head's Δloss the plain way (one full forward per head) on the same batches."""
    from llmcli.evaluation.text import eval_tokens, window_batches, window_starts
    from llmcli.inspection.ablation import head_deltas_full
    from llmcli.runs.loading import load_run

    run = load_run(run_dir)
    tokens, _ = eval_tokens(run)
    starts = window_starts(len(tokens), CTX, run.config.train.batch_size, steps)
    return head_deltas_full(run.model, window_batches(tokens, CTX, starts, "cpu"), ("zero", "mean"))


def test_command_ablation_adds_dloss_columns_and_the_top_heads(run_dir, tmp_path, capsys) -> None:
    from llmcli.inspection.viewer import viewer_data

    args = ["inspect-attention", "--checkpoint", str(run_dir), "--prompt", "Speak, speak."]
    args += ["--ablation", "both", "--no-pictures", "--out", str(tmp_path)]
    code, out, err = cli(args, capsys)
    assert code == 0, err
    names = [*METRIC_NAMES, "dloss_zero", "dloss_mean"]
    assert ["layer", "head", *names] in [line.split() for line in out.splitlines()]
    assert "top heads by dloss_zero" in out and "top heads by dloss_mean" in out
    dump = load_dump(tmp_path / "attention.npz")
    assert dump.metric_names == names and dump.metrics.shape == (2, 4, 6)
    ref = reference_deltas(run_dir, report.ABLATION_STEPS)
    np.testing.assert_allclose(dump.metrics[..., 4], ref.delta["zero"], atol=1e-5)
    np.testing.assert_allclose(dump.metrics[..., 5], ref.delta["mean"], atol=1e-5)
    note = dump.meta["ablation"]
    assert note["base_loss"] == pytest.approx(ref.base_loss, rel=1e-6)
    assert note["tokens"] == ref.tokens and note["steps"] == report.ABLATION_STEPS
    assert np.array(note["delta"]["zero"]).shape == (2, 4)
    data = viewer_data(load_dump(tmp_path / "attention.npz"))
    assert data["metric_names"] == names and len(data["metrics"][0][0]) == 6


def test_command_ablation_follows_the_selection(run_dir, tmp_path, capsys) -> None:
    args = ["inspect-attention", "--checkpoint", str(run_dir), "--prompt", "Speak"]
    # A bare --ablation (followed by another option here) is zero ablation.
    args += ["--layer", "1", "--head", "2", "--ablation", "--ablation-steps", "1"]
    code, out, err = cli([*args, "--no-pictures", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    dump = load_dump(tmp_path / "attention.npz")
    assert dump.metric_names[-1] == "dloss_zero" and dump.metrics.shape == (1, 1, 5)
    full = np.array(dump.meta["ablation"]["delta"]["zero"])  # every head, whatever the selection
    assert full.shape == (2, 4) and dump.metrics[0, 0, -1] == pytest.approx(full[1, 2])
    assert "dloss_mean" not in out and not (tmp_path / "ablation.png").exists()


def test_ablation_on_a_data_file_equals_evals_loss_with_the_head_removed(
    run_dir, tmp_path, capsys
) -> None:
    from llmcli.evaluation.run import EvalOptions, evaluate_run

    # The corpus's characters in another order: 30 full windows (batches of 12, 12, 6) and a
    # shorter last one, all within the default 20 batches.
    text = tmp_path / "text.txt"
    text.write_text("All:\nYou are all resolved rather to die?\nSpeak, speak.\n" * 9)
    args = ["inspect-attention", "--checkpoint", str(run_dir), "--prompt", "Speak"]
    args += ["--ablation", "both", "--data", str(text), "--no-pictures", "--out", str(tmp_path)]
    code, out, err = cli(args, capsys)
    assert code == 0, err
    note = load_dump(tmp_path / "attention.npz").meta["ablation"]
    assert note["data"] == note["data_file"] == str(text)
    assert f"head ablation on 4 batches of {text} (494 tokens)" in out
    plain = evaluate_run(run_dir, text, EvalOptions(device="cpu"))
    assert note["base_loss"] == pytest.approx(plain.loss, rel=1e-6)
    assert note["tokens"] == plain.tokens
    for method, head in [("zero", "0.1"), ("mean", "1.3")]:
        removed = evaluate_run(
            run_dir, text, EvalOptions(ablate=[head], ablation=method, device="cpu")
        )
        layer, h = map(int, head.split("."))
        delta = note["delta"][method][layer][h]
        assert abs(delta) > 1e-4  # the head matters here, so the check says something
        assert delta == pytest.approx(removed.loss - plain.loss, abs=1e-5)


def test_the_heat_map_is_written_with_the_pictures(tmp_path) -> None:
    from llmcli.inspection.ablation import HeadDeltas

    dump = make_dump()  # layers [0, 2], heads [0, 1, 3] of a 3 x 4 model
    delta = np.arange(12.0).reshape(3, 4) / 10
    result = HeadDeltas(base_loss=2.0, delta={"zero": delta}, batches=1, tokens=10)
    report.add_ablation([dump], result, {**result.to_dict(), "steps": 1})
    np.testing.assert_allclose(dump.metrics[..., -1], delta[[0, 2]][:, [0, 1, 3]], rtol=1e-6)
    files = report.write_outputs(dump, tmp_path, viewer=False)
    assert [p.name for p in files] == [
        "attention.npz",
        "layer-0.png",
        "layer-2.png",
        "ablation.png",
    ]
    assert (tmp_path / "ablation.png").read_bytes().startswith(b"\x89PNG")
