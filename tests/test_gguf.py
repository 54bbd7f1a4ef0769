"""`llmcli export --format gguf`: the file read back with gguf's own `GGUFReader`.

Every tensor is compared with the run's weights under a hand-written name table, the metadata
with the run's config and tokenizer, and the file's model is run in NumPy as llama.cpp's graph
for its architecture computes it (`numpy_forward`) against llmcli's logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import save_tiny_run

from llmcli.cli import main
from llmcli.data.tokenizer import BPETokenizer, CharTokenizer
from llmcli.runs.loading import load_run

TEXT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me! O Romeo, Romeo!\n"
SHAPE = {"n_layer": 2, "n_head": 2, "n_embed": 16, "context_length": 12}
# A model option set per llama.cpp architecture.
ARCH_OPTIONS = {
    "gpt2": {},
    "gptneox": {"pos_emb": "rope"},
    "arcee": {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "relu2", "bias": False},
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train([TEXT * 4], 300)


def make_run(run_dir: Path, tokenizer, **model) -> Path:
    raw = {"model": {**SHAPE, **model}, "data": {"tokenizer": "bpe"}}
    return save_tiny_run(run_dir, tokenizer, raw, seed=1, sharpen=4.0)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def export(capsys, run_dir: Path, out: Path, *extra: str) -> gguf.GGUFReader:
    args = ("export", "--checkpoint", str(run_dir), "--format", "gguf", "--out", str(out))
    code, stdout, stderr = cli(capsys, *args, *extra)
    assert code == 0, stderr
    assert str(out) in stdout
    return gguf.GGUFReader(out)


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def tensors(reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
    return {t.name: np.array(t.data) for t in reader.tensors}


def expected_tensors(run_dir: Path, arch: str) -> dict[str, np.ndarray]:
    """The run's weights under llama.cpp's names, built from its state dict by a name table."""
    run = load_run(run_dir)
    sd = {k: v.numpy() for k, v in run.model.state_dict().items()}
    cfg = run.config.model
    C, nh = cfg.n_embed, cfg.n_head
    hs = C // nh
    # llama.cpp's Llama rope pairs channels (2j, 2j+1); llmcli's pairs (j, j + hs/2).
    perm = [h * hs + j // 2 + (j % 2) * (hs // 2) for h in range(nh) for j in range(hs)]
    names = {"attn_norm": "ln1", "attn_qkv": "attn.qkv", "attn_output": "attn.proj"}
    names |= {"ffn_norm": "ln2", "ffn_up": "mlp.fc", "ffn_down": "mlp.proj"}
    out = {"token_embd.weight": sd["wte.weight"], "output_norm.weight": sd["ln_f.weight"]}
    if cfg.pos_emb == "learned":
        out["position_embd.weight"] = sd["wpe.weight"]
    biases = arch != "arcee"
    if biases:
        out["output_norm.bias"] = sd.get("ln_f.bias", np.zeros(C, np.float32))
    for i in range(cfg.n_layer):
        for gg, ours in names.items():
            weight = sd[f"blocks.{i}.{ours}.weight"]
            if gg == "attn_qkv" and arch == "arcee":
                q, k, v = weight[:C], weight[C : 2 * C], weight[2 * C :]
                weight = np.concatenate([q[perm], k[perm], v])
            out[f"blk.{i}.{gg}.weight"] = weight
            if biases:
                zeros = np.zeros(weight.shape[0], np.float32)
                out[f"blk.{i}.{gg}.bias"] = sd.get(f"blocks.{i}.{ours}.bias", zeros)
    if arch == "gptneox" or not cfg.tie_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    return out


# --- the file's model run in NumPy, as llama.cpp's graphs compute it --------------------------


def _norm(x, w, b, rms: bool, eps: float):
    if rms:
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _rope(x, base: float, interleaved: bool):
    """x (T, nh, hs) rotated: pairs (2j, 2j+1) (Llama) or (j, j + hs/2) (NeoX)."""
    T, _, hs = x.shape
    theta = np.arange(T)[:, None] * base ** (-np.arange(0, hs, 2) / hs)  # (T, hs/2)
    cos, sin = np.cos(theta)[:, None], np.sin(theta)[:, None]  # (T, 1, hs/2)
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : hs // 2], x[..., hs // 2 :])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    if interleaved:
        return np.stack([ra, rb], axis=-1).reshape(x.shape)
    return np.concatenate([ra, rb], axis=-1)


def numpy_forward(reader: gguf.GGUFReader, ids: list[int]) -> np.ndarray:
    """Logits (T, V) of the GGUF file's model for `ids`, in float64."""
    t = {k: v.astype(np.float64) for k, v in tensors(reader).items()}
    arch = field(reader, "general.architecture")
    nh = int(field(reader, f"{arch}.attention.head_count"))
    L = int(field(reader, f"{arch}.block_count"))
    rms = arch == "arcee"
    eps = float(field(reader, f"{arch}.attention.layer_norm_{'rms_' if rms else ''}epsilon"))
    zero = np.zeros(1)
    T = len(ids)
    x = t["token_embd.weight"][ids]  # (T, C)
    if "position_embd.weight" in t:
        x = x + t["position_embd.weight"][:T]
    C = x.shape[1]
    hs = C // nh
    for i in range(L):
        p = f"blk.{i}."
        h = _norm(x, t[p + "attn_norm.weight"], t.get(p + "attn_norm.bias", zero), rms, eps)
        qkv = h @ t[p + "attn_qkv.weight"].T + t.get(p + "attn_qkv.bias", zero)  # (T, 3C)
        q, k, v = (m.reshape(T, nh, hs) for m in np.split(qkv, 3, axis=-1))
        if arch != "gpt2":
            base = float(field(reader, f"{arch}.rope.freq_base"))
            q, k = _rope(q, base, rms), _rope(k, base, rms)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hs)  # (nh, T, T)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = np.einsum("hqk,khd->qhd", att, v).reshape(T, C)
        x = x + y @ t[p + "attn_output.weight"].T + t.get(p + "attn_output.bias", zero)
        h = _norm(x, t[p + "ffn_norm.weight"], t.get(p + "ffn_norm.bias", zero), rms, eps)
        u = h @ t[p + "ffn_up.weight"].T + t.get(p + "ffn_up.bias", zero)
        if rms:
            u = np.maximum(u, 0) ** 2
        else:
            u = 0.5 * u * (1 + np.vectorize(math.erf)(u / math.sqrt(2)))
        x = x + u @ t[p + "ffn_down.weight"].T + t.get(p + "ffn_down.bias", zero)
    x = _norm(x, t["output_norm.weight"], t.get("output_norm.bias", zero), rms, eps)
    return x @ t.get("output.weight", t["token_embd.weight"]).T


# --- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("gpt2", {}),
        ("gpt2", {"bias": False, "tie_embeddings": False}),
        ("gptneox", {}),
        ("gptneox", {"bias": False}),
        ("arcee", {}),
        ("arcee", {"tie_embeddings": False}),
    ],
)
def test_f32_file_holds_every_weight_and_computes_the_run(tmp_path, capsys, bpe, arch, extra):
    run_dir = make_run(tmp_path / "run", bpe, **ARCH_OPTIONS[arch], **extra)
    reader = export(capsys, run_dir, tmp_path / "model.gguf")
    assert field(reader, "general.architecture") == arch
    got, want = tensors(reader), expected_tensors(run_dir, arch)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert reader.tensors[[t.name for t in reader.tensors].index(name)].tensor_type == 0
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    # The file's model, run as llama.cpp's graph, gives llmcli's logits.
    run = load_run(run_dir)
    ids = bpe.encode("ROMEO: But soft")[: SHAPE["context_length"]]
    with torch.no_grad():
        logits, _ = run.model(torch.tensor([ids]))
    np.testing.assert_allclose(numpy_forward(reader, ids), logits[0].double(), atol=1e-4)


def test_metadata_and_vocabulary_are_the_runs(tmp_path, capsys, bpe):
    run_dir = make_run(tmp_path / "run", bpe, pos_emb="rope", rope_base=500.0)
    reader = export(capsys, run_dir, tmp_path / "model.gguf")
    a = "gptneox"
    assert field(reader, f"{a}.context_length") == SHAPE["context_length"]
    assert field(reader, f"{a}.embedding_length") == SHAPE["n_embed"]
    assert field(reader, f"{a}.block_count") == SHAPE["n_layer"]
    assert field(reader, f"{a}.attention.head_count") == SHAPE["n_head"]
    assert field(reader, f"{a}.attention.head_count_kv") == SHAPE["n_head"]
    assert field(reader, f"{a}.feed_forward_length") == 4 * SHAPE["n_embed"]
    assert field(reader, f"{a}.rope.dimension_count") == SHAPE["n_embed"] // SHAPE["n_head"]
    assert field(reader, f"{a}.rope.freq_base") == pytest.approx(500.0)
    assert field(reader, f"{a}.use_parallel_residual") is False
    assert field(reader, f"{a}.attention.layer_norm_epsilon") == pytest.approx(1e-5)
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert tokens == [bpe.hf.id_to_token(i) for i in range(bpe.vocab_size)]
    merges = json.loads(bpe.to_json())["model"]["merges"]
    assert field(reader, "tokenizer.ggml.merges") == [
        m if isinstance(m, str) else " ".join(m) for m in merges
    ]
    assert len(merges) == bpe.vocab_size - 257  # every token past the bytes and EOT is a merge
    types = field(reader, "tokenizer.ggml.token_type")
    assert types[bpe.eot_id] == 3 and set(types[: bpe.eot_id] + types[bpe.eot_id + 1 :]) == {1}
    assert field(reader, "tokenizer.ggml.eos_token_id") == bpe.eot_id
    assert field(reader, "tokenizer.ggml.bos_token_id") == bpe.eot_id
    assert field(reader, "tokenizer.ggml.add_bos_token") is False


def test_f16_file_holds_matrices_in_float16_and_vectors_in_float32(tmp_path, capsys, bpe):
    run_dir = make_run(tmp_path / "run", bpe)
    reader = export(capsys, run_dir, tmp_path / "model.gguf", "--dtype", "f16")
    assert field(reader, "general.file_type") == 1
    want = expected_tensors(run_dir, "gpt2")
    for t in reader.tensors:
        value = want[t.name]
        if value.ndim == 2:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16, t.name
            # Within float16 rounding: exactly the nearest float16 of each weight.
            np.testing.assert_array_equal(np.array(t.data), value.astype(np.float16))
            assert np.abs(np.array(t.data, np.float32) - value).max() <= np.abs(value).max() / 1024
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
            np.testing.assert_array_equal(np.array(t.data), value)


def test_char_run_is_refused_with_what_works_instead(tmp_path, capsys):
    run_dir = make_run(tmp_path / "run", CharTokenizer.train([TEXT]))
    out = tmp_path / "model.gguf"
    code, _, err = cli(capsys, "export", "--checkpoint", str(run_dir), "--format", "gguf",
                       "--out", str(out))  # fmt: skip
    assert code == 2 and not out.exists()
    assert "char-level" in err and "--format auto" in err and "data.tokenizer: bpe" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"norm": "rmsnorm"}, "model.norm"),
        ({"qk_norm": True}, "model.qk_norm"),
        ({"mlp": "relu2"}, "model.mlp"),
        ({"pos_emb": "rope", "norm": "rmsnorm", "mlp": "relu2"}, "model.bias"),
        ({"pos_emb": "rope", "norm": "rmsnorm"}, "model.mlp"),
    ],
)
def test_options_llama_cpp_cannot_compute_are_refused(tmp_path, capsys, bpe, options, named):
    run_dir = make_run(tmp_path / "run", bpe, **options)
    out = tmp_path / "model.gguf"
    code, _, err = cli(capsys, "export", "--checkpoint", str(run_dir), "--format", "gguf",
                       "--out", str(out))  # fmt: skip
    assert code == 2 and not out.exists()
    assert named in err and "no llama.cpp architecture" in err


def test_existing_file_needs_force_and_bad_dtype_exits_2(tmp_path, capsys, bpe):
    run_dir = make_run(tmp_path / "run", bpe)
    out = tmp_path / "model.gguf"
    out.write_bytes(b"old")
    args = ("export", "--checkpoint", str(run_dir), "--format", "gguf", "--out", str(out))
    code, _, err = cli(capsys, *args)
    assert code == 2 and "--force" in err and out.read_bytes() == b"old"
    code, _, err = cli(capsys, *args, "--dtype", "q4")
    assert code == 2 and "f32 or f16" in err
    code, _, err = cli(capsys, *args, "--force")
    assert code == 0 and gguf.GGUFReader(out).tensors
    code, _, err = cli(capsys, "export", "--checkpoint", str(run_dir), "--out",
                       str(tmp_path / "hf"), "--dtype", "f16")  # fmt: skip
    assert code == 2 and "--format gguf" in err
