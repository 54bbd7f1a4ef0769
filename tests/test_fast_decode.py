"""The opt-in one-token decode step (llmcli/generation/fast_decode.py) against the plain code it
stands in for: `FastDecoder`'s logits and cache against `Transformer.forward`'s for every
combination of recipe option values, with and without padding (bit for bit, except a GELU model
on the CPU: within a few float32 ulps); `generate`'s tokens with it against the plain loop's;
where it steps aside (hooks, autocast, training mode); and `gelu` against ATen's GELU kernel."""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from model_helpers import gen, randomize_, tiny_model

from llmcli.config import SampleConfig
from llmcli.generation import fast_decode
from llmcli.generation.engine import generate_ids, padded_mask, padded_positions
from llmcli.generation.fast_decode import FastDecoder

pytestmark = pytest.mark.usefixtures("one_thread")

CHOICES = [
    ("pos_emb", "learned", "rope"),
    ("norm", "layernorm", "rmsnorm"),
    ("qk_norm", False, True),
    ("mlp", "gelu", "relu2"),
    ("bias", True, False),
    ("tie_embeddings", True, False),
]
# Every combination of the recipe options' values: 64 tiny models.
OPTIONS = [
    {name: value for (name, *_), value in zip(CHOICES, combo, strict=True)}
    for combo in itertools.product(*(values for _, *values in CHOICES))
]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def option_id(opts: dict) -> str:
    return "-".join(str(v) for v in opts.values())


def assert_same_logits(got: torch.Tensor, expected: torch.Tensor, exact: bool, name: str) -> None:
    """Bit for bit where `exact`; else (oneDNN's GELU in the forward, ATen's here) within a few
    float32 ulps, and the same greedy token."""
    if exact:
        assert torch.equal(got, expected), name
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=name)
        assert torch.equal(got.argmax(-1), expected.argmax(-1)), name


@contextmanager
def aten_gelu_forward():
    """torch with oneDNN off (in a test only): its GELU is ATen's, which the fast step runs."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opts", OPTIONS, ids=[option_id(o) for o in OPTIONS])
def test_fast_decode_equals_forward(opts, device) -> None:
    """Bit for bit against the forward run with the same kernels (for a GELU model on the CPU:
    the forward with oneDNN off); within a few ulps of the forward on oneDNN's GELU."""
    model = randomize_(tiny_model(**opts)).eval().to(device)
    on_onednn = opts["mlp"] == "gelu" and device == "cpu"  # the forward's GELU is oneDNN's
    onednn = torch.backends.mkldnn.enabled
    g = gen(1)
    B = 3
    for padded in (False, True):
        with torch.inference_mode():
            prompt = torch.randint(37, (B, 5), generator=g).to(device)  # (B, 5)
            pads = torch.tensor([2, 0, 4] if padded else [0, 0, 0], device=device)
            mask = padded_mask(pads, 5, 5) if padded else None
            pos = padded_positions(pads, 5, 5) if padded else None
            ours, same, theirs = (model.new_kv_cache(B) for _ in range(3))
            with aten_gelu_forward():
                model(prompt, mask=mask, input_pos=pos, kv_cache=ours)
                model(prompt, mask=mask, input_pos=pos, kv_cache=same)
            model(prompt, mask=mask, input_pos=pos, kv_cache=theirs)
            decoder = FastDecoder.for_model(model)
            for t in range(8):
                idx = torch.randint(37, (B,), generator=g).to(device)  # (B,)
                T_k = 5 + t + 1
                mask = padded_mask(pads, 1, T_k) if padded else None  # (B, 1, 1, T_k)
                pos = padded_positions(pads, 1, T_k) if padded else None  # (B, 1)
                with aten_gelu_forward():
                    expected, _ = model(idx[:, None], mask=mask, input_pos=pos, kv_cache=same)
                onednn_expected, _ = model(idx[:, None], mask=mask, input_pos=pos, kv_cache=theirs)
                got = decoder(idx, ours, mask, pos)
                name = f"step {t}, padded={padded}"
                assert torch.equal(got, expected[:, -1]), name
                assert_same_logits(got, onednn_expected[:, -1], not on_onednn, name)
        assert ours.length == same.length == theirs.length == 13
        assert torch.equal(ours.k, same.k) and torch.equal(ours.v, same.v)
        if not on_onednn:
            assert torch.equal(ours.k, theirs.k) and torch.equal(ours.v, theirs.v)
    assert torch.backends.mkldnn.enabled is onednn  # no process-wide switch left behind


def test_only_for_a_transformer_in_eval_mode() -> None:
    model = tiny_model()
    assert isinstance(FastDecoder.for_model(model), FastDecoder)
    assert FastDecoder.for_model(model.train()) is None  # dropout: the forward's business
    assert FastDecoder.for_model(torch.nn.Linear(2, 2)) is None
    assert isinstance(FastDecoder.for_model(model.eval()), FastDecoder)
    # an adapter applied on the fly computes more than its layer's weight, which is all the
    # decoder reads: the model decodes through its forward
    from llmcli.config import LoraConfig
    from llmcli.model.lora import add_lora

    add_lora(model, LoraConfig(rank=2, targets=["mlp.fc"]))
    assert FastDecoder.for_model(model) is None


def test_a_model_put_in_training_mode_later_decodes_through_its_forward() -> None:
    model = tiny_model()
    decoder = FastDecoder.for_model(model)
    cache = model.new_kv_cache(1)
    with torch.no_grad():
        model(torch.tensor([[1, 2]]), kv_cache=cache)
        assert decoder(torch.tensor([3]), cache, None, None) is not None
        model.train()
        assert decoder(torch.tensor([4]), cache, None, None) is None  # dropout: not here
    assert cache.length == 3  # the refused step wrote nothing


def test_steps_aside_under_a_hook_or_autocast_and_touches_nothing() -> None:
    model = randomize_(tiny_model(mlp="relu2"))
    decoder = FastDecoder.for_model(model)
    prompt = torch.randint(37, (2, 4), generator=gen(1))
    with torch.inference_mode():
        ours, theirs = model.new_kv_cache(2), model.new_kv_cache(2)
        model(prompt, kv_cache=ours)
        model(prompt, kv_cache=theirs)
        idx = torch.tensor([3, 5])
        with model.hooks({"blocks.1.mlp_out": lambda x: None}):  # hooks see every step
            assert decoder(idx, ours, None, None) is None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert decoder(idx, ours, None, None) is None
        assert ours.length == 4 and torch.equal(ours.k, theirs.k) and torch.equal(ours.v, theirs.v)
        got = decoder(idx, ours, None, None)  # the hook and autocast have left: it applies
        expected, _ = model(idx[:, None], kv_cache=theirs)
    assert torch.equal(got, expected[:, -1])
    assert ours.length == theirs.length == 5


# ----------------------------------------------------------------------------- generation

CONTEXT = 8
PROMPTS = [[3], [1, 2, 3, 4, 5], list(range(1, 13)), [7, 7, 2]]  # 12 > context_length
BATCHES = {  # left-padded inside the context, one past it, a prompt alone
    "padded": [[3], [1, 2, 3, 4, 5], [7, 7, 2]],
    "padded-long": PROMPTS,
    "alone": [[1, 2, 3, 4, 5]],
}
GENERATIONS = {  # settings: inside the context, and past it under each policy
    "greedy-exact": dict(temperature=0.0, context_policy="exact", max_new_tokens=4),
    "sampled-shift": dict(temperature=1.0, context_policy="shift", max_new_tokens=30),
    "top-k-p-shift-keep-1": dict(
        temperature=0.8, top_k=10, top_p=0.9, context_policy="shift", context_keep=1
    ),
    "sampled-exact": dict(temperature=1.0, context_policy="exact", max_new_tokens=20),
}


def counted(decoder: FastDecoder, calls: list[bool]):
    """`decoder`, noting for every call whether it gave logits."""

    def decode(*args):
        logits = decoder(*args)
        calls.append(logits is not None)
        return logits

    return decode


@pytest.mark.parametrize("mlp", ["gelu", "relu2"])
@pytest.mark.parametrize("settings", GENERATIONS.values(), ids=GENERATIONS.keys())
def test_generate_with_fast_decode_gives_the_plain_loops_tokens(mlp, settings) -> None:
    model = randomize_(tiny_model(mlp=mlp, context_length=CONTEXT, vocab_size=40), seed=2)
    for seed in (0, 1, 7):
        config = SampleConfig(**{"max_new_tokens": 25, "top_k": None, **settings, "seed": seed})
        for batch, prompts in BATCHES.items():
            plain = generate_ids(model, prompts, config)
            calls: list[bool] = []
            decoder = counted(FastDecoder.for_model(model), calls)
            fast = generate_ids(model, prompts, config, decode=decoder)
            assert fast == plain, f"seed {seed}, {batch}"
            assert all(calls)  # no hook, no autocast: it gave logits whenever it was asked
            # The cache, and with it the decode steps, is used unless `exact` starts full.
            if config.context_policy == "shift" or batch != "padded-long":
                assert calls, f"seed {seed}, {batch}: no decode step ran"


def test_one_decoder_serves_generations_one_after_another() -> None:
    """A decoder keeps views of the cache it last saw; a new generation's cache replaces them."""
    model = randomize_(tiny_model(mlp="relu2", context_length=CONTEXT))
    config = SampleConfig(max_new_tokens=20, temperature=1.0, top_k=None, seed=4)
    decoder = FastDecoder.for_model(model)
    first = generate_ids(model, [[1, 2]], config, decode=decoder)
    second = generate_ids(model, PROMPTS, config, decode=decoder)
    assert first == generate_ids(model, [[1, 2]], config)
    assert second == generate_ids(model, PROMPTS, config)


# ----------------------------------------------------------------------------- gelu


@pytest.mark.parametrize("rows", [1, 3, fast_decode.ATEN_GELU_MAX // 512, 40])
def test_the_mlp_hidden_rows_run_atens_gelu_bit_for_bit_and_leave_onednn_alone(rows) -> None:
    """Small steps run GELU on ATen's kernel (the one torch runs with oneDNN off), larger ones
    torch's own; the process-wide oneDNN switch is never touched."""
    fc = randomize_(torch.nn.Linear(128, 512), seed=3)
    block = fast_decode._Block(None, None, None, None, fast_decode._linear(fc), None)
    hidden = fast_decode._AtenGeluHidden()
    x = torch.randn(rows, 128, generator=gen(4))
    before = torch.backends.mkldnn.enabled
    results = {}
    try:
        with torch.inference_mode():
            for enabled in (True, False):
                torch.backends.mkldnn.enabled = enabled
                results[enabled] = (hidden(block, x).clone(), F.gelu(fc(x)))
                assert torch.backends.mkldnn.enabled is enabled
    finally:
        torch.backends.mkldnn.enabled = before
    h = fc(x).detach()
    aten = results[False][1]  # torch's GELU with oneDNN off: ATen's kernel
    exact = 0.5 * h * (1.0 + torch.special.erf(h / 2.0**0.5))
    torch.testing.assert_close(aten, exact, atol=1e-6, rtol=1e-6)
    assert torch.equal(results[False][0], aten)
    small = rows * 512 <= fast_decode.ATEN_GELU_MAX
    assert torch.equal(results[True][0], aten if small else results[True][1])


def test_a_decoder_used_in_inference_mode_serves_under_no_grad_after() -> None:
    model = randomize_(tiny_model())
    decoder = FastDecoder.for_model(model)
    logits = []
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            cache = model.new_kv_cache(1)
            model(torch.tensor([[1, 2]]), kv_cache=cache)
            logits.append(decoder(torch.tensor([3]), cache, None, None))
    assert torch.equal(logits[0], logits[1])
