"""`llmcli eval` (llmcli/evaluation/run.py, text.py): loss, perplexity and bits per byte
against hand sums."""

from __future__ import annotations

import json
import math
import os
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import save_tiny_run

import llmcli.evaluation.text
from llmcli.cli import main
from llmcli.data.tokenizer import BPETokenizer, CharTokenizer
from llmcli.device import usable_cpus
from llmcli.errors import InputError
from llmcli.evaluation.run import EvalOptions, evaluate_run
from llmcli.evaluation.text import score_tokens, text_bytes, window_batches, window_starts

CTX, BATCH = 16, 3
# Multi-byte characters (é: 2 bytes, —: 3 bytes) make bytes differ from characters.
TEXT = (
    "ROMEO: But soft, what light through yonder window breaks?\n"
    "JULIET: Ay me! — Café, où est l'été?\n"
) * 3


pytestmark = pytest.mark.usefixtures("one_thread")


def make_run(run_dir: Path, tokenizer, data: dict | None = None) -> Path:
    model = {"n_layer": 2, "n_head": 2, "n_embed": 32, "context_length": CTX}
    raw = {"model": model, "data": data or {}, "train": {"batch_size": BATCH}}
    return save_tiny_run(run_dir, tokenizer, raw, sharpen=6.0, extra_meta={"step": 7})


def reference_nll(run_dir: Path, ids: list[int], hooks: dict | None = None) -> np.ndarray:
    """Per-token negative log-likelihoods by hand: window k predicts ids[kT+1 .. kT+T] from
    ids[kT .. kT+T-1], one window at a time, log-softmax in float64 NumPy; `hooks` run at the
    model's hook points."""
    from llmcli.runs.loading import load_run

    model = load_run(run_dir).model
    out = []
    for s in range(0, len(ids) - 1, CTX):
        x = ids[s : s + CTX]
        y = ids[s + 1 : s + CTX + 1]
        x = x[: len(y)]
        with torch.no_grad(), model.hooks(hooks or {}):
            logits, _ = model(torch.tensor([x]))
        z = logits[0].double().numpy()  # (L, V)
        logz = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
        out.extend(logz - z[np.arange(len(y)), y])
    return np.asarray(out)


def removed(means: torch.Tensor | None = None) -> dict:
    """Hooks that remove head 1 of layer 0 and both heads of layer 1 (`--ablate 0.1 --ablate 1`)
    by hand: their slices of `attn.z` `(B, T, H, hs)` replaced by zeros, or by their `means`
    `(L, H, hs)`."""

    def replace(layer: int, heads: list[int]):
        def fn(z: torch.Tensor) -> torch.Tensor:
            z = z.clone()
            for h in heads:
                z[:, :, h] = 0.0 if means is None else means[layer, h]
            return z

        return fn

    return {"blocks.0.attn.z": replace(0, [1]), "blocks.1.attn.z": replace(1, [0, 1])}


@pytest.fixture(scope="module")
def char_run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "char", CharTokenizer.train([TEXT]))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "eval.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_loss_perplexity_and_bits_per_byte_on_a_file_match_a_hand_computation(
    char_run: Path, text_file: Path
) -> None:
    result = evaluate_run(char_run, text_file, EvalOptions(device="cpu"))
    ids = CharTokenizer.train([TEXT]).encode(TEXT)
    nll = reference_nll(char_run, ids)
    assert len(nll) == len(TEXT) - 1  # every character after the first, once
    total_bytes = len(TEXT[1:].encode("utf-8"))
    assert total_bytes > len(TEXT) - 1  # the multi-byte characters count
    assert result.tokens == len(TEXT) - 1 and result.bytes == total_bytes
    assert result.windows == math.ceil((len(TEXT) - 1) / CTX)
    assert result.loss == pytest.approx(nll.mean(), rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nll.mean()), rel=1e-5)
    assert result.bits_per_token == pytest.approx(nll.mean() / math.log(2), rel=1e-5)
    assert result.bits_per_byte == pytest.approx(nll.sum() / math.log(2) / total_bytes, rel=1e-5)
    assert result.step == 7 and result.data == str(text_file)


def test_steps_scores_only_the_first_batches(char_run: Path, text_file: Path) -> None:
    result = evaluate_run(char_run, text_file, EvalOptions(steps=2, device="cpu"))
    n = 2 * BATCH * CTX  # two batches of BATCH full windows
    nll = reference_nll(char_run, CharTokenizer.train([TEXT]).encode(TEXT))[:n]
    assert result.tokens == n and result.windows == 2 * BATCH
    assert result.bytes == len(TEXT[1 : n + 1].encode("utf-8"))
    assert result.loss == pytest.approx(nll.mean(), rel=1e-5)
    assert result.bits_per_byte == pytest.approx(nll.sum() / math.log(2) / result.bytes, rel=1e-5)
    # The batch size changes how windows are grouped, not what they score.
    whole = evaluate_run(char_run, text_file, EvalOptions(batch_size=1, device="cpu"))
    assert whole.loss == pytest.approx(evaluate_run(char_run, text_file).loss, rel=1e-6)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (9, [[0, 4]]),  # n - 1 = 2T: two full windows, no token left over
        (10, [[0, 4], [8]]),  # one token more: a last window predicting it alone
        (8, [[0], [4]]),  # one fewer: the second window is the short one, alone in its batch
        (2, [[0]]),  # the shortest stream: one window predicting one token
    ],
)
def test_windows_predict_every_token_after_the_first_once_up_to_the_streams_end(
    n, expected
) -> None:
    starts = window_starts(n, 4, 8)
    assert starts == expected
    tokens = np.arange(n)
    targets = [y.flatten() for _, y in window_batches(tokens, 4, starts, "cpu")]
    assert torch.cat(targets).tolist() == list(range(1, n))


def test_default_data_is_the_runs_validation_split(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 4, encoding="utf-8")
    tok = CharTokenizer.train([TEXT])
    run = make_run(
        tmp_path / "run",
        tok,
        data={"path": str(corpus), "val_fraction": 0.25, "cache_dir": str(tmp_path / "cache")},
    )
    result = evaluate_run(run, options=EvalOptions(device="cpu"))
    ids = tok.encode(TEXT * 4)
    val = ids[int(len(ids) * 0.75) :]  # the last val_fraction of the token stream
    nll = reference_nll(run, val)
    assert result.tokens == len(val) - 1
    assert result.loss == pytest.approx(nll.mean(), rel=1e-5)
    assert result.data == f"validation split of {corpus}"


def test_bpe_bits_per_byte_counts_bytes_and_leaves_special_tokens_out(tmp_path: Path) -> None:
    tok = BPETokenizer.train([TEXT * 2], vocab_size=300)
    text = TEXT + "<|endoftext|>" + TEXT[:50]
    path = tmp_path / "bpe.txt"
    path.write_text(text, encoding="utf-8")
    run = make_run(tmp_path / "run", tok)
    ids = tok.encode(text)
    assert tok.eot_id in ids and len(ids) < len(text)
    result = evaluate_run(run, path, EvalOptions(device="cpu"))
    nll = reference_nll(run, ids)
    targets = np.asarray(ids[1:])
    is_text = targets != tok.eot_id
    text_bytes = len((TEXT + TEXT[:50]).encode("utf-8")) - len(tok.decode(ids[:1]).encode())
    assert result.tokens == len(ids) - 1 and result.bytes == text_bytes
    assert result.loss == pytest.approx(nll.mean(), rel=1e-5)
    assert result.bits_per_byte == pytest.approx(
        nll[is_text].sum() / math.log(2) / text_bytes, rel=1e-5
    )


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 64])
def test_text_bytes_counts_a_character_split_over_a_decoding_chunks_edge_once(
    monkeypatch, chunk
) -> None:
    """Byte-level BPE spells a character it has no token for in byte tokens (é: 2, —: 3, 🙂:
    4); where a decoding chunk ends between them, the character still counts its own bytes,
    not two replacement characters' (3 bytes each)."""
    tok = BPETokenizer.train(["hello world abc " * 50], vocab_size=260)
    text = "ab é — x🙂<|endoftext|>yz 🙂"
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    assert len(ids) > 12  # the rare characters are several tokens each
    monkeypatch.setattr(llmcli.evaluation.text, "DECODE_CHUNK", chunk)
    assert text_bytes(tok, ids) == len(text.replace("<|endoftext|>", "").encode("utf-8"))


def test_per_token_losses_are_the_hand_computed_cross_entropies(
    char_run: Path, text_file: Path
) -> None:
    tok = CharTokenizer.train([TEXT])
    ids = tok.encode(TEXT)
    nll = reference_nll(char_run, ids)
    result = evaluate_run(char_run, text_file, EvalOptions(per_token=True, device="cpu"))
    records = result.per_token
    assert [r["window"] for r in records] == list(range(math.ceil((len(ids) - 1) / CTX)))
    assert [r["start"] for r in records] == list(range(0, len(ids) - 1, CTX))
    for r in records:
        s = r["start"]
        assert r["ids"] == ids[s + 1 : s + 1 + len(r["losses"])]
        assert r["tokens"] == list(TEXT[s + 1 : s + 1 + len(r["losses"])])
    losses = np.concatenate([r["losses"] for r in records])
    np.testing.assert_allclose(losses, nll, atol=2e-6)  # rounded to 1e-6
    assert result.loss == pytest.approx(nll.mean(), rel=1e-5)
    assert "per_token" not in result.to_dict()
    assert evaluate_run(char_run, text_file, EvalOptions(device="cpu")).per_token is None


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_cli_json_and_text_output_and_the_latest_run_by_default(
    capsys, tmp_path: Path, char_run: Path, text_file: Path
) -> None:
    code, out, err = cli(
        capsys,
        "eval",
        "--checkpoint",
        str(char_run),
        "--data",
        str(text_file),
        "--json",
        "--device",
        "cpu",
    )
    assert code == 0, err
    record = json.loads(out)
    expected = evaluate_run(char_run, text_file, EvalOptions(device="cpu")).to_dict()
    assert record.keys() == expected.keys()
    for key in ("loss", "perplexity", "bits_per_byte", "tokens", "bytes", "step"):
        assert record[key] == pytest.approx(expected[key])

    make_run(tmp_path / "checkpoints" / "latest", CharTokenizer.train([TEXT]))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code, out, err = cli(capsys, "eval", "--data", str(text_file), "--steps", "1")
    finally:
        os.chdir(cwd)
    assert code == 0, err
    assert "checkpoints/latest" in out and "bits/byte" in out and "perplexity" in out


def test_cli_per_token_prints_json_lines_and_the_summary_on_stderr(
    capsys, char_run: Path, text_file: Path
) -> None:
    args = ["eval", "--checkpoint", str(char_run), "--data", str(text_file), "--device", "cpu"]
    code, out, err = cli(capsys, *args, "--per-token", "--ablate", "1.0", "--json")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == math.ceil((len(TEXT) - 1) / CTX)
    records = [json.loads(line) for line in lines]
    expected = evaluate_run(
        char_run, text_file, EvalOptions(ablate=["1.0"], per_token=True, device="cpu")
    )
    assert records == expected.per_token
    assert "".join(t for r in records for t in r["tokens"]) == TEXT[1:]
    summary = json.loads(err.strip().splitlines()[-1])
    assert summary["loss"] == pytest.approx(expected.loss) and summary["ablate"] == ["1.0"]


@pytest.mark.parametrize("case", ["missing", "binary", "empty", "unknown_chars", "steps", "no_run"])
def test_bad_input_exits_2_with_a_message(
    capsys, tmp_path: Path, char_run: Path, case: str
) -> None:
    data = tmp_path / "data.txt"
    args = ["eval", "--checkpoint", str(char_run), "--data", str(data)]
    if case == "binary":
        data.write_bytes(b"abc\xff\xfe")
    elif case == "empty":
        data.write_text("")
    elif case == "unknown_chars":
        data.write_text("ROMEO 1234 {}")
    elif case == "steps":
        data.write_text(TEXT)
        args += ["--steps", "0"]
    elif case == "no_run":
        data.write_text(TEXT)
        args[2] = str(tmp_path / "nowhere")
    code, out, err = cli(capsys, *args)
    assert code == 2 and out == ""
    expected = {
        "missing": "does not exist",
        "binary": "not UTF-8",
        "empty": "empty",
        "unknown_chars": "vocabulary lacks",
        "steps": "--steps",
        "no_run": "does not exist",
    }[case]
    assert err.startswith("error: ") and expected in err and "Traceback" not in err


# ------------------------------------------------------------------ --ablate


def test_a_mask_of_ones_scores_bit_for_bit_as_plain_eval(char_run: Path) -> None:
    from llmcli.evaluation.heads import head_means, mask_heads
    from llmcli.runs.loading import load_run

    model = load_run(char_run).model
    tokens = np.asarray(CharTokenizer.train([TEXT]).encode(TEXT), dtype=np.int64)
    plain = score_tokens(model, tokens, CTX, BATCH)
    ones = torch.ones(2)
    starts = window_starts(len(tokens), CTX, BATCH)
    means = head_means(model, window_batches(tokens, CTX, starts, "cpu"))
    for head_mean in (None, means):
        fns = {
            f"blocks.{i}.attn.z": partial(
                mask_heads, keep=ones, mean=None if head_mean is None else head_mean[i]
            )
            for i in range(2)
        }
        with model.hooks(fns):
            masked = score_tokens(model, tokens, CTX, BATCH)
        assert masked == plain  # every sum, bit for bit


def test_ablate_removes_heads_zero_and_mean(char_run: Path, text_file: Path) -> None:
    from llmcli.evaluation.heads import head_means

    plain = evaluate_run(char_run, text_file, EvalOptions(device="cpu"))
    ids = CharTokenizer.train([TEXT]).encode(TEXT)
    zero = evaluate_run(char_run, text_file, EvalOptions(ablate=["0.1", "1"], device="cpu"))
    assert (zero.ablate, zero.ablation) == (["0.1", "1"], "zero")
    assert zero.loss == pytest.approx(reference_nll(char_run, ids, removed()).mean(), rel=1e-5)
    assert abs(zero.loss - plain.loss) > 1e-3

    from llmcli.runs.loading import load_run

    model = load_run(char_run).model
    n = len(ids)  # every window's inputs, the shorter last one included
    windows = [(torch.tensor([ids[s : min(s + CTX, n - 1)]]), None) for s in range(0, n - 1, CTX)]
    means = head_means(model, windows)
    mean = evaluate_run(
        char_run, text_file, EvalOptions(ablate=["0.1", "1"], ablation="mean", device="cpu")
    )
    ref = reference_nll(char_run, ids, removed(means)).mean()
    assert mean.ablation == "mean" and mean.loss == pytest.approx(ref, rel=1e-5)
    assert abs(mean.loss - zero.loss) > 1e-4


def test_cli_ablate(capsys, char_run: Path, text_file: Path) -> None:
    args = ["eval", "--checkpoint", str(char_run), "--data", str(text_file), "--device", "cpu"]
    code, out, err = cli(capsys, *args, "--ablate", "1.0", "--ablation", "mean", "--json")
    assert code == 0, err
    record = json.loads(out)
    expected = evaluate_run(
        char_run, text_file, EvalOptions(ablate=["1.0"], ablation="mean", device="cpu")
    )
    assert (record["ablate"], record["ablation"]) == (["1.0"], "mean")
    assert record["loss"] == expected.loss
    code, out, err = cli(capsys, *args, "--ablate", "0", "--ablate", "1.1")
    assert code == 0, err
    assert "heads removed (zero ablation): 0, 1.1" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--ablate", "9.9"],
            r"layer 9 is past the last layer \(1\).*L from 0 to 1 and H from 0 to 1",
        ),
        (["--ablate", "0.2"], r"head 2 is past the last head \(1\)"),
        (["--ablate", "x"], r"'x' is not a head or a layer: write L.H .* or L .*L from 0 to 1"),
        (["--ablate", "1."], r"'1.' is not a head or a layer"),
        (["--ablate", "-1"], r"'-1' is not a head or a layer"),
        (["--ablation", "foo"], r"--ablation 'foo' is not known: choose zero or mean"),
        (["--ablate", "0", "--ablation", "foo"], r"--ablation 'foo' is not known"),
        (["--ablation", "mean"], r"--ablation mean says how --ablate removes heads: give --ablate"),
        (["--ablate", "1" * 5000], r"is not a head or a layer"),
        (["--ablate", "\u0663"], r"is not a head or a layer"),  # an Arabic-Indic 3
    ],
)
def test_cli_bad_ablation_exits_2(capsys, char_run: Path, text_file: Path, args, message) -> None:
    import re

    base = ["eval", "--checkpoint", str(char_run), "--data", str(text_file), "--device", "cpu"]
    code, out, err = cli(capsys, *base, *args)
    assert code == 2 and out == "", err
    assert err.startswith("error: ") and "Traceback" not in err
    assert re.search(message, err.replace("\n", " ")), err


@pytest.mark.parametrize(
    ("options", "argv", "message"),
    [
        ({"steps": 0}, ["--steps", "0"], r"--steps \(0\) must be a positive number of batches"),
        ({"batch_size": 0}, ["--batch-size", "0"], r"--batch-size \(0\) must be positive"),
        ({"ablation": "foo"}, ["--ablation", "foo"], r"--ablation 'foo' is not known: choose zero"),
        (
            {"ablate": ["0"], "ablation": "both"},
            ["--ablate", "0", "--ablation", "both"],
            r"--ablation 'both' is not known",
        ),
        (
            {"ablation": "mean"},
            ["--ablation", "mean"],
            r"--ablation mean says how --ablate removes heads: give --ablate",
        ),
    ],
)
def test_options_are_checked_as_they_are_made_before_a_run_loads(
    capsys, tmp_path: Path, options, argv, message
) -> None:
    import re

    with pytest.raises(InputError, match=message):
        EvalOptions(**options)
    # The command makes its options first: no run is looked for (there is none here).
    code, out, err = cli(capsys, "eval", "--checkpoint", str(tmp_path / "none"), *argv)
    assert code == 2 and out == "" and err.startswith("error: ")
    assert re.search(message, err.replace("\n", " ")), err


def test_eval_runs_on_the_threads_asked_for_else_the_runs_own(tmp_path, monkeypatch) -> None:
    import llmcli.evaluation.run as evaluate

    model = {"n_layer": 2, "n_head": 2, "n_embed": 32, "context_length": CTX}
    raw = {"model": model, "train": {"batch_size": BATCH, "threads": 2}}
    run = save_tiny_run(tmp_path / "run", CharTokenizer.train([TEXT]), raw, sharpen=6.0)
    (tmp_path / "t.txt").write_text(TEXT)
    seen = []
    real = evaluate.score_tokens

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate, "score_tokens", recording)
    before = torch.get_num_threads()
    own = evaluate_run(run, tmp_path / "t.txt")
    one = evaluate_run(run, tmp_path / "t.txt", EvalOptions(threads=1))
    assert seen == [min(2, usable_cpus()), 1]  # the run's train.threads, then --threads
    assert torch.get_num_threads() == before  # put back after
    assert one.loss == pytest.approx(own.loss, rel=1e-6)
    with pytest.raises(InputError, match=r"--threads \(0\) must be in 1\.\."):
        EvalOptions(threads=0)


def test_mean_ablation_shows_its_first_pass_and_the_scoring_pass(
    tmp_path, monkeypatch, caplog
) -> None:
    import io
    import logging
    import sys

    tokenizer = CharTokenizer.train([TEXT])
    run = make_run(tmp_path / "run", tokenizer)
    (tmp_path / "t.txt").write_text(TEXT)
    batches = len(window_starts(len(tokenizer.encode(TEXT)), CTX, BATCH))
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: plain lines
    options = EvalOptions(ablate=("0.1",), ablation="mean")
    with caplog.at_level(logging.INFO, logger="llmcli.progress"):
        evaluate_run(run, tmp_path / "t.txt", options, progress=True)
    lines = [r.getMessage().split(",")[0] for r in caplog.records if r.name == "llmcli.progress"]
    tenths = sorted({-(-k * batches // 10) for k in range(1, 11)})  # ceil(k * n / 10)
    assert lines == [f"head means {n}/{batches}" for n in tenths] + [
        f"eval {n}/{batches}" for n in tenths
    ]
