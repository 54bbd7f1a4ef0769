"""Hook points (llmcli/model/hooks.py): their names and shapes for every architecture option,
reading and replacing activations, and the looks inside that are built on them (the attention
dump of `inspect-attention`, the heads `eval --ablate` removes) against hand-made hooks."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from attention_helpers import CORPUS, build_model
from conftest import save_tiny_run
from model_helpers import assert_close, gen, randomize_, tiny_model

import llmcli.model.gpt
from llmcli.config import SampleConfig
from llmcli.data.tokenizer import CharTokenizer
from llmcli.errors import InputError
from llmcli.evaluation.run import EvalOptions, evaluate_run
from llmcli.generation.engine import generate
from llmcli.generation.fast_decode import FastDecoder
from llmcli.inspection.attention import build_dumps

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIONS = {
    "default": {},
    "rope": {"pos_emb": "rope"},
    "rmsnorm": {"norm": "rmsnorm"},
    "qk_norm": {"qk_norm": True},
    "untied": {"tie_embeddings": False},
    "relu2": {"mlp": "relu2"},
    "all": {
        "pos_emb": "rope",
        "norm": "rmsnorm",
        "qk_norm": True,
        "tie_embeddings": False,
        "mlp": "relu2",
        "bias": False,
    },
}
PER_BLOCK = (
    "resid_pre",
    "attn_in",
    "attn.pattern",
    "attn.z",
    "attn_out",
    "resid_mid",
    "mlp_in",
    "mlp_out",
    "resid_post",
)


def any_hook_at_work(model) -> bool:
    return any(point.active for _, point in model.named_modules() if hasattr(point, "active"))


def expected_names(n_layer: int) -> list[str]:
    blocks = [f"blocks.{i}.{name}" for i in range(n_layer) for name in PER_BLOCK]
    return ["embed", *blocks, "final_norm"]


def expected_shape(name: str, B: int, T: int) -> tuple[int, ...]:
    C, nh, hs = 32, 4, 8  # tiny_model
    if name.endswith("attn.pattern"):
        return (B, nh, T, T)
    if name.endswith("attn.z"):
        return (B, T, nh, hs)
    return (B, T, C)


@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_every_architecture_option_has_the_same_hook_points_with_their_shapes(opts) -> None:
    model = tiny_model(n_layer=3, **opts)
    assert model.hook_names() == expected_names(3)
    seen = {}
    record = {name: (lambda x, name=name: seen.__setitem__(name, x)) for name in expected_names(3)}
    idx = torch.randint(37, (2, 9), generator=gen(1))
    with model.hooks(record):
        model(idx)
    assert list(seen) == expected_names(3)  # in the order the forward meets them
    for name, x in seen.items():
        assert tuple(x.shape) == expected_shape(name, 2, 9), name


@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
def test_hooks_that_return_their_input_change_no_logit_bit(opts) -> None:
    model = randomize_(tiny_model(**opts))
    idx = torch.randint(37, (2, 16), generator=gen(1))
    plain, _ = model(idx)
    names = [n for n in model.hook_names() if not n.endswith("attn.pattern")]
    with model.hooks({name: (lambda x: x) for name in names}):
        assert torch.equal(model(idx)[0], plain)
    with model.hooks({name: (lambda x: None) for name in names}):
        assert torch.equal(model(idx)[0], plain)
    # Reading a pattern makes that layer compute its weights explicitly: the same maths as the
    # fused kernel, to rounding.
    with model.hooks({"blocks.1.attn.pattern": lambda w: w}):
        assert_close(model(idx)[0], plain, "an explicit layer's logits vs the fused layer's")


def test_the_logits_are_the_final_norm_through_the_lm_head_and_replacements_flow_on() -> None:
    model = randomize_(tiny_model())
    idx = torch.randint(37, (2, 16), generator=gen(1))
    seen = {}
    with model.hooks({"final_norm": lambda x: seen.setdefault("final_norm", x)}):
        logits, _ = model(idx)
    assert_close(logits, seen["final_norm"] @ model.wte.weight.T, "logits vs final_norm @ W_E^T")
    # Replacing the last block's output: the logits are the final norm and head of the new one.
    stream = torch.randn(2, 16, 32, generator=gen(2))
    with model.hooks({"blocks.1.resid_post": lambda x: stream}):
        logits, _ = model(idx)
    assert_close(logits, model.to_logits(stream), "logits of a replaced residual stream")
    # Replacing every pattern of layer 0 by attention to the first token only.
    first = torch.zeros(2, 4, 16, 16)
    first[..., 0] = 1.0
    z = {}
    with model.hooks(
        {"blocks.0.attn.pattern": lambda w: first, "blocks.0.attn.z": lambda x: z.setdefault(0, x)}
    ):
        model(idx)
    with model.hooks({"blocks.0.resid_pre": lambda x: z.setdefault("in", x)}):
        model(idx)
    attn = model.blocks[0].attn
    v = model.blocks[0].ln1(z["in"]) @ attn.qkv.weight[64:].T + attn.qkv.bias[64:]  # (B, T, C)
    expected = v[:, :1].expand(-1, 16, -1).reshape(2, 16, 4, 8)  # every query: token 0's value
    assert_close(z[0], expected, "z under a replaced pattern")


def test_the_values_at_the_hook_points_add_up_along_the_residual_stream() -> None:
    model = randomize_(tiny_model())
    idx = torch.randint(37, (2, 9), generator=gen(1))
    seen = {}
    record = {n: (lambda x, n=n: seen.__setitem__(n, x)) for n in model.hook_names()}
    with torch.no_grad(), model.hooks(record):
        model(idx)
        embed = model.wte.weight[idx] + model.wpe.weight[:9]  # (B, T, C)
        assert_close(seen["embed"], embed, "embed vs wte[idx] + wpe[:T]")
        assert torch.equal(seen["blocks.0.resid_pre"], seen["embed"])
        assert torch.equal(seen["blocks.1.resid_pre"], seen["blocks.0.resid_post"])
        for i, block in enumerate(model.blocks):
            get = lambda name, i=i: seen[f"blocks.{i}.{name}"]  # noqa: E731
            z = get("attn.z")  # (B, T, nh, hs)
            assert_close(get("attn_out"), block.attn.proj(z.flatten(2)), f"{i} attn_out")
            assert_close(get("resid_mid"), get("resid_pre") + get("attn_out"), f"{i} resid_mid")
            assert_close(get("attn_in"), block.ln1(get("resid_pre")), f"{i} attn_in")
            assert_close(get("mlp_in"), block.ln2(get("resid_mid")), f"{i} mlp_in")
            mlp = block.mlp(get("mlp_in"))
            assert_close(get("mlp_out"), mlp, f"{i} mlp_out vs mlp(ln2(resid_mid))")
            assert_close(get("resid_post"), get("resid_mid") + get("mlp_out"), f"{i} resid_post")
        assert_close(seen["final_norm"], model.ln_f(seen["blocks.1.resid_post"]), "final_norm")


def test_equal_functions_nest_at_one_point_and_each_block_takes_its_own_away() -> None:
    model = tiny_model()
    idx = torch.zeros(1, 3, dtype=torch.long)
    calls = []
    double = lambda x: calls.append(1) or x * 2  # noqa: E731
    plain, _ = model(idx)
    with model.hooks({"blocks.0.mlp_out": double}):
        with model.hooks({"blocks.0.mlp_out": double}):
            assert len(model.blocks[0].mlp_out.fns) == 2
            model(idx)
            assert len(calls) == 2  # both ran
        assert model.blocks[0].mlp_out.fns == [double]
        assert model.blocks[0].mlp_out.active and any_hook_at_work(model)
        assert not torch.equal(model(idx)[0], plain)
    assert model.blocks[0].mlp_out.fns == [] and not any_hook_at_work(model)
    assert torch.equal(model(idx)[0], plain)


def test_a_list_of_functions_at_one_point_runs_in_order_as_nested_blocks_do() -> None:
    model = tiny_model()
    idx = torch.zeros(1, 3, dtype=torch.long)
    add, scale = (lambda x: x + 1), (lambda x: x * 3)  # order matters: (x + 1) * 3 != x * 3 + 1
    with model.hooks({"blocks.0.mlp_out": add}), model.hooks({"blocks.0.mlp_out": scale}):
        nested, _ = model(idx)
    with model.hooks({"blocks.0.mlp_out": [add, scale]}):
        assert model.blocks[0].mlp_out.fns == [add, scale]
        listed, _ = model(idx)
    with model.hooks({"blocks.0.mlp_out": [scale, add]}):
        swapped, _ = model(idx)
    assert torch.equal(listed, nested) and not torch.equal(listed, swapped)
    assert model.blocks[0].mlp_out.fns == []
    with pytest.raises(InputError, match="is a int, not a function"):
        with model.hooks({"blocks.0.mlp_out": [add, 3]}):
            pass
    assert model.blocks[0].mlp_out.fns == []


def test_a_replacement_that_cannot_stand_for_the_activation_is_refused_by_name() -> None:
    model = tiny_model()
    idx = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(InputError, match="'blocks.1.attn_out' returned a tensor of shape"):
        with model.hooks({"blocks.1.attn_out": lambda x: x[:, :1]}):
            model(idx)
    with pytest.raises(InputError, match="'embed' returned a list"):
        with model.hooks({"embed": lambda x: [x]}):
            model(idx)
    with pytest.raises(InputError, match="'embed' returned a tensor .*torch.float64"):
        with model.hooks({"embed": lambda x: x.double()}):
            model(idx)
    with pytest.raises(InputError, match="the hook for 'embed' is a int, not a function"):
        with model.hooks({"embed": 3}):
            pass
    assert not any_hook_at_work(model)


@pytest.mark.parametrize("fast", [False, True], ids=["forward", "fast-decode"])
def test_a_hook_added_while_a_generation_runs_sees_its_next_steps(fast) -> None:
    """Also with a `FastDecoder`, which gives the steps back to the forward while a hook is at
    work (its own tests: test_fast_decode.py)."""
    model = randomize_(tiny_model(mlp="relu2"))  # relu2: fast decode's logits are the forward's
    config = SampleConfig(max_new_tokens=6, temperature=1.0, top_k=None, seed=3)
    expected = [t.clone() for t in generate(model, [[1, 2, 3]], config)]
    decode = FastDecoder.for_model(model) if fast else None
    steps, seen = generate(model, [[1, 2, 3]], config, decode=decode), []
    got = [next(steps), next(steps)]
    with model.hooks({"embed": seen.append}):
        got.append(next(steps))
        got.append(next(steps))
    got += list(steps)
    assert [tuple(x.shape) for x in seen] == [(1, 1, 32)] * 2  # one new token per step
    assert torch.equal(torch.stack(got), torch.stack(expected))


@pytest.mark.parametrize("point", ["blocks.1.resid_pre", "final_norm"])
def test_a_failing_hook_leaves_the_kv_cache_length_as_it_was(point) -> None:
    """`KVCache.length` moves only after every block ran: a forward that raises on the way (here
    after layer 0, or after both layers, wrote position 5) leaves it unchanged, and the next
    forward writes over what the failed one left."""
    model = randomize_(tiny_model())
    idx = torch.randint(37, (2, 8), generator=gen(1))
    other = torch.randint(37, (2, 1), generator=gen(2))  # the failed step's token, not idx's
    cache = model.new_kv_cache(2)
    with torch.no_grad():
        model(idx[:, :5], kv_cache=cache)

        def fail(x: torch.Tensor) -> None:
            raise RuntimeError("a broken hook")

        with pytest.raises(RuntimeError, match="a broken hook"), model.hooks({point: fail}):
            model(other, kv_cache=cache)
        assert cache.length == 5
        assert (cache.k[0, :, :, 5] != 0).any()  # it did write past the length
        logits, _ = model(idx[:, 5:], kv_cache=cache)
        full, _ = model(idx)
    assert cache.length == 8
    assert_close(logits, full[:, 5:], "decoding on after the failed step vs one forward")


def test_the_pattern_is_computed_only_for_the_layers_that_are_read(monkeypatch) -> None:
    model = tiny_model(n_layer=3)
    calls = []
    real = llmcli.model.gpt.attention_weights
    monkeypatch.setattr(
        llmcli.model.gpt, "attention_weights", lambda *a: calls.append(1) or real(*a)
    )
    idx = torch.randint(37, (1, 8), generator=gen(1))
    model(idx)
    assert calls == []
    with model.hooks({"blocks.2.attn.pattern": lambda w: None}):
        model(idx)
    assert calls == [1]


def test_unknown_names_are_refused_and_functions_leave_with_the_block() -> None:
    model = tiny_model()
    with pytest.raises(
        InputError, match="'blocks.0.attn.patern' is not a hook point.*attn.pattern"
    ):
        with model.hooks({"blocks.0.attn.patern": print}):
            pass
    calls = []
    with pytest.raises(RuntimeError), model.hooks({"embed": calls.append}):
        model(torch.zeros(1, 2, dtype=torch.long))
        raise RuntimeError
    model(torch.zeros(1, 2, dtype=torch.long))
    assert len(calls) == 1
    assert not any(point.fns for _, point in model.named_modules() if hasattr(point, "fns"))


def test_a_pattern_read_by_a_hook_equals_inspect_attentions_dump() -> None:
    """The dump is built on the hook; that the weights themselves are right (against
    `torch.nn.MultiheadAttention`) is checked in test_attention_capture."""
    _, tok, model = build_model()
    for prompt in ("Before we procee", "All:\nSpeak"):
        (dump,) = build_dumps(model, tok, [prompt])
        patterns = []
        hooks = {f"blocks.{i}.attn.pattern": patterns.append for i in range(model.n_layer)}
        with torch.no_grad(), model.hooks(hooks):
            model(torch.tensor([tok.encode(prompt)]))
        read = torch.stack([p[0] for p in patterns])  # (L, H, T, T)
        assert torch.equal(torch.from_numpy(dump.attn), read)


@pytest.mark.parametrize(("layer", "head"), list(itertools.product(range(2), range(2))))
def test_zeroing_a_head_at_its_hook_point_gives_eval_ablate_loss(tmp_path, layer, head) -> None:
    tok = CharTokenizer.train([CORPUS])
    model = {"n_layer": 2, "n_head": 2, "n_embed": 32, "context_length": 16}
    run = save_tiny_run(tmp_path / "run", tok, {"model": model}, sharpen=6.0)
    text = tmp_path / "text.txt"
    text.write_text(CORPUS, encoding="utf-8")
    ablated = evaluate_run(run, text, EvalOptions(ablate=[f"{layer}.{head}"], device="cpu"))

    from llmcli.runs.loading import load_run

    def zero(z: torch.Tensor) -> torch.Tensor:  # (B, T, H, hs)
        z = z.clone()
        z[:, :, head] = 0.0
        return z

    loaded = load_run(run).model
    ids = torch.tensor(tok.encode(CORPUS))
    windows = [ids[s : s + 17] for s in range(0, len(ids) - 1, 16)]
    nll = []
    with torch.no_grad(), loaded.hooks({f"blocks.{layer}.attn.z": zero}):
        for w in windows:
            logits, _ = loaded(w[None, :-1])
            nll.append(torch.nn.functional.cross_entropy(logits[0], w[1:], reduction="none"))
    assert ablated.loss == pytest.approx(torch.cat(nll).double().mean().item(), rel=1e-6)


def test_the_documented_example_runs_as_written(tmp_path, monkeypatch, capsys) -> None:
    page = Path(__file__).resolve().parents[1] / "docs" / "hook-points.md"
    section = page.read_text(encoding="utf-8")
    code = section[
        section.index("```python\n") + 10 : section.index("\n```", section.index("```python"))
    ]
    tok = CharTokenizer.train([CORPUS + "ROMEO: What say you, my lord?"])
    model = {"n_layer": 2, "n_head": 4, "n_embed": 32, "context_length": 32}
    save_tiny_run(tmp_path / "checkpoints" / "tiny", tok, {"model": model}, sharpen=6.0)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(page), "exec"), scope)
    assert len(scope["patterns"]) == 2 and scope["patterns"][0].shape == (1, 4, 28, 28)
    assert scope["ablated"] != scope["loss"]
    assert capsys.readouterr().out.startswith("loss ")
