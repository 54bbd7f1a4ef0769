"""Muon (llmcli/training/muon.py) and its wiring into the optimizer groups
(llmcli/training/optim.py)."""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest
import torch

from llmcli.config import ModelConfig, TrainConfig, config_from_dict, load_config
from llmcli.errors import ConfigError
from llmcli.model.gpt import Transformer
from llmcli.training.muon import NS_COEFFS, AdamWDefaults, Muon, muon_param_groups, newton_schulz
from llmcli.training.optim import apply_lr, build_optimizer, param_groups


def reference_newton_schulz(G: np.ndarray, steps: int = 5) -> np.ndarray:
    """The quintic iteration written out in float64 NumPy, one matrix at a time."""
    a, b, c = NS_COEFFS
    X = G.astype(np.float64)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (np.linalg.norm(X) + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def conditioned(rows: int, cols: int, cond: float, seed: int) -> np.ndarray:
    """A random matrix with singular values spread log-uniformly over [1/cond, 1] (times 3)."""
    rng = np.random.default_rng(seed)
    k = min(rows, cols)
    U, _ = np.linalg.qr(rng.standard_normal((rows, k)))
    V, _ = np.linalg.qr(rng.standard_normal((cols, k)))
    s = 3.0 * np.logspace(0, -np.log10(cond), k)
    return (U * s) @ V.T


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32), (16, 24), (24, 16)])
def test_newton_schulz_matches_the_formula(shape: tuple[int, int]) -> None:
    G = np.random.default_rng(0).standard_normal(shape)
    got = newton_schulz(torch.tensor(G, dtype=torch.float32))
    np.testing.assert_allclose(got.numpy(), reference_newton_schulz(G), atol=2e-5, rtol=1e-4)


def test_newton_schulz_orthogonalises_each_matrix_of_a_stack() -> None:
    mats = [conditioned(24, 40, cond, seed) for seed, cond in enumerate((5, 20, 50))]
    stacked = torch.tensor(np.stack(mats), dtype=torch.float32)  # (3, 24, 40)
    got = newton_schulz(stacked).double().numpy()
    assert got.shape == (3, 24, 40)
    for G, X in zip(mats, got, strict=True):
        np.testing.assert_allclose(X, reference_newton_schulz(G), atol=2e-5)
        U, s, Vt = np.linalg.svd(G, full_matrices=False)
        # Same singular vectors as G: U^T X V is diagonal ...
        inner = U.T @ X @ Vt.T
        off = inner - np.diag(np.diag(inner))
        assert np.abs(off).max() < 1e-4
        # ... and the singular values, whatever G's (spread 50x here), end near 1.
        sv = np.linalg.svd(X, compute_uv=False)
        assert sv.min() > 0.6 and sv.max() < 1.25, sv
        # So X is close to the exact orthogonal polar factor U V^T.
        polar = U @ Vt
        assert np.linalg.norm(X - polar) / np.linalg.norm(polar) < 0.3


def test_newton_schulz_keeps_zero_and_dtype() -> None:
    z = torch.zeros(4, 6, dtype=torch.bfloat16)
    out = newton_schulz(z)
    assert out.dtype == torch.bfloat16 and torch.count_nonzero(out) == 0


def reference_muon(
    W: np.ndarray, grads: list[np.ndarray], lrs: list[float], mu: float, wd: float, nesterov: bool
) -> np.ndarray:
    """Muon's update rule by hand (the llmcli.training.muon docstring), float64; `lrs[k]` is
    step k's learning rate."""
    W = W.astype(np.float64).copy()
    M = np.zeros_like(W)
    rows, cols = W.shape
    for G, lr in zip(grads, lrs, strict=True):
        M = mu * M + (1 - mu) * G
        U = (1 - mu) * G + mu * M if nesterov else M
        W = W * (1 - lr * wd) - lr * np.sqrt(max(1.0, rows / cols)) * reference_newton_schulz(U)
    return W


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_steps_match_a_hand_computation(nesterov: bool) -> None:
    rng = np.random.default_rng(1)
    shapes = [(24, 8), (24, 8), (8, 24), (12, 12)]  # two of one shape: updated as one stack
    weights = [rng.standard_normal(s) * 0.1 for s in shapes]
    grads = [[rng.standard_normal(s) for _ in range(3)] for s in shapes]
    params = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float32)) for w in weights]
    opt = Muon(
        [{"params": params, "use_muon": True}],
        lr=0.05,
        momentum=0.9,
        nesterov=nesterov,
        weight_decay=0.1,
    )
    for k in range(3):
        for p, g in zip(params, grads, strict=True):
            p.grad = torch.tensor(g[k], dtype=torch.float32)
        opt.step()
    for p, w, g in zip(params, weights, grads, strict=True):
        expected = reference_muon(w, g, [0.05] * 3, mu=0.9, wd=0.1, nesterov=nesterov)
        np.testing.assert_allclose(p.detach().numpy(), expected, atol=1e-5)


def test_muon_update_has_unit_singular_values_times_lr() -> None:
    # One step from zero momentum: W moves by lr * NS(G), whose singular values are near 1.
    G = conditioned(32, 16, 30.0, 7)
    p = torch.nn.Parameter(torch.zeros(32, 16))
    p.grad = torch.tensor(G, dtype=torch.float32)
    Muon([{"params": [p], "use_muon": True}], lr=0.1, momentum=0.0).step()
    sv = np.linalg.svd(p.detach().double().numpy() / (-0.1 * np.sqrt(2.0)), compute_uv=False)
    assert sv.min() > 0.6 and sv.max() < 1.25


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_groups_are_torch_adamw_bit_for_bit(fused: bool) -> None:
    torch.manual_seed(0)
    shapes = [(5, 3), (7,), (4, 4)]
    a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ours = Muon(
        [
            {"params": a[:2], "use_muon": False, "weight_decay": 0.1},
            {"params": a[2:], "use_muon": False, "weight_decay": 0.0, "lr": 3e-3},
        ],
        adamw=AdamWDefaults(lr=1e-2, betas=(0.8, 0.95), eps=1e-8, fused=fused),
    )
    ref = torch.optim.AdamW(
        [
            {"params": b[:2], "weight_decay": 0.1},
            {"params": b[2:], "weight_decay": 0.0, "lr": 3e-3},
        ],
        lr=1e-2,
        betas=(0.8, 0.95),
        eps=1e-8,
        **({"fused": True} if fused else {"foreach": True}),
    )
    for _ in range(5):
        grads = [torch.randn(s) for s in shapes]
        for p, q, g in zip(a, b, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
        assert ours.state[p].keys() == ref.state[q].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in ours.state[p].items():
            assert torch.equal(value, ref.state[q][key]) and value.dtype == ref.state[q][key].dtype


def test_a_save_with_int_adamw_steps_continues_as_one_with_tensor_steps() -> None:
    # Up to 5b00014 the AdamW groups kept `step` as an int and had no `fused` key; such a save
    # loads (the foreach kernel, step counts as tensors) and, once a resume has put today's
    # hyperparameters back (llmcli.training.run), continues as a save of today's does.
    def trained(params: list[torch.nn.Parameter]) -> Muon:
        return Muon([{"params": params, "use_muon": False}], adamw=AdamWDefaults(lr=1e-2))

    torch.manual_seed(0)
    p = [torch.nn.Parameter(torch.randn(4, 3))]
    opt = trained(p)
    grads = [torch.randn(4, 3) for _ in range(4)]
    for g in grads[:2]:
        p[0].grad = g.clone()
        opt.step()
    state = opt.state_dict()
    old = {
        "state": {k: {**v, "step": int(v["step"])} for k, v in state["state"].items()},
        "param_groups": [
            {k: v for k, v in g.items() if k != "fused"} for g in state["param_groups"]
        ],
    }
    runs = []
    for saved in (state, old):
        q = [torch.nn.Parameter(p[0].detach().clone())]
        resumed = trained(q)
        resumed.load_state_dict(copy.deepcopy(saved))  # a copy, as from disk
        group = resumed.param_groups[0]
        assert group["fused"] is (saved is state)
        assert resumed.state[q[0]]["step"].dtype == torch.float32
        assert resumed.state[q[0]]["step"].item() == 2
        group["fused"] = True  # today's hyperparameters, as a resume puts them back
        for g in grads[2:]:
            q[0].grad = g.clone()
            resumed.step()
        runs.append(q[0].detach())
    assert torch.equal(runs[0], runs[1])


def test_the_speedrun_recipes_first_steps_follow_the_muon_formula_and_torch_adamw() -> None:
    # configs/speedrun-cpu.yaml as shipped (Muon 0.02 at momentum 0.85 with Nesterov, AdamW 3e-2,
    # rotary, ReLU², RMSNorm, tied head, WSD with warmup, clipping at 1.0), narrower so the
    # test takes a second. Hidden matrices must follow the update rule written out in float64
    # NumPy (`reference_muon`), every other parameter `torch.optim.AdamW` bit for bit.
    cfg = load_config("speedrun-cpu", ["model.n_embed=32", "model.context_length=16"])
    train, T, V = cfg.train, cfg.model.context_length, 11
    model = Transformer(cfg.model, V, generator=torch.Generator().manual_seed(0))
    opt = build_optimizer(model, train, "cpu")
    hidden, *rest = muon_param_groups(model, train, param_groups(model, train.weight_decay))
    assert opt.param_groups[0]["params"] == hidden["params"] and len(hidden["params"]) == 8
    start = [p.detach().double().numpy().copy() for p in hidden["params"]]
    copies = {p: torch.nn.Parameter(p.detach().clone()) for g in rest for p in g["params"]}
    ref = torch.optim.AdamW(
        [{**g, "params": [copies[p] for p in g["params"]]} for g in rest],
        betas=(train.beta1, train.beta2),
        eps=1e-8,
        fused=True,
    )
    gen = torch.Generator().manual_seed(1)
    grads: list[list[np.ndarray]] = [[] for _ in hidden["params"]]
    lrs = []
    for step in range(5):
        lrs.append(apply_lr(opt, step, train) * train.muon_lr / train.lr)
        apply_lr(ref, step, train)
        tokens = torch.randint(0, V, (train.batch_size, T + 1), generator=gen)  # (B, T + 1)
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        for p, g in zip(hidden["params"], grads, strict=True):
            g.append(p.grad.double().numpy().copy())
        for p, q in copies.items():
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        opt.zero_grad(set_to_none=True)
        for p, q in copies.items():
            assert torch.equal(p, q)
    mu = train.muon_momentum
    for p, w0, g in zip(hidden["params"], start, grads, strict=True):
        moved = reference_muon(w0, g, lrs, mu=mu, wd=0.0, nesterov=True) - w0
        # The float32 iteration against float64: within 0.1% of the largest move.
        np.testing.assert_allclose(
            p.detach().double().numpy() - w0, moved, rtol=0, atol=1e-3 * np.abs(moved).max()
        )


def test_muon_groups_refuse_vectors_and_need_use_muon() -> None:
    with pytest.raises(ValueError, match="2-D"):
        Muon([{"params": [torch.nn.Parameter(torch.ones(3))], "use_muon": True}])
    with pytest.raises(ValueError, match="use_muon"):
        Muon([{"params": [torch.nn.Parameter(torch.ones(3, 3))]}])


def tiny_model(**overrides) -> Transformer:
    cfg = ModelConfig(n_layer=2, n_head=2, n_embed=16, context_length=8, **overrides)
    return Transformer(cfg, 11, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tie", [True, False])
def test_routing_muon_for_hidden_matrices_adamw_for_the_rest(tie: bool) -> None:
    model = tiny_model(tie_embeddings=tie, pos_emb="learned")
    train = TrainConfig(optimizer="muon", lr=2e-3, muon_lr=0.03, weight_decay=0.1)
    muon, decay, no_decay = muon_param_groups(model, train, param_groups(model, train.weight_decay))
    expected_hidden = {
        f"blocks.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    }
    assert set(muon["names"]) == expected_hidden and muon["use_muon"]
    assert set(decay["names"]) == {"wte.weight", "wpe.weight"} | (
        set() if tie else {"lm_head.weight"}
    )
    named = dict(model.named_parameters())
    assert all(named[n].dim() == 1 for n in no_decay["names"])  # norm gains and biases
    assert "ln_f.weight" in no_decay["names"] and "blocks.0.attn.qkv.bias" in no_decay["names"]
    ids = [id(p) for g in (muon, decay, no_decay) for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert (muon["lr"], decay["lr"], no_decay["lr"]) == (0.03, 2e-3, 2e-3)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)


def test_build_optimizer_muon_follows_the_schedule_and_trains() -> None:
    model = tiny_model(
        norm="rmsnorm", qk_norm=True, mlp="relu2", pos_emb="rope", tie_embeddings=False
    )
    train = TrainConfig(
        optimizer="muon",
        lr=1e-2,
        min_lr=0.0,
        muon_lr=0.05,
        warmup_steps=0,
        max_steps=40,
        beta1=0.8,
        beta2=0.95,
        muon_momentum=0.85,
    )
    opt = build_optimizer(model, train, "cpu")
    assert isinstance(opt, Muon)
    assert opt.param_groups[0]["momentum"] == 0.85
    assert opt.param_groups[1]["betas"] == (0.8, 0.95)
    x = torch.randint(0, 11, (4, 8), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(40):
        lr = apply_lr(opt, step, train)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * lr / 1e-2)
        _, loss = model(x, x)  # learn to copy the input: easy, so the loss must fall
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]


def test_muon_momentum_is_validated() -> None:
    with pytest.raises(ConfigError, match="train.muon_momentum"):
        config_from_dict({"train": {"optimizer": "muon", "muon_momentum": 1.0}})


def test_state_dict_round_trip_continues_exactly() -> None:
    def run(split: bool) -> list[torch.Tensor]:
        model = tiny_model()
        train = TrainConfig(optimizer="muon", lr=1e-2, muon_lr=0.05, weight_decay=0.1)
        opt = build_optimizer(model, train, "cpu")
        gen = torch.Generator().manual_seed(3)
        for step in range(6):
            if split and step == 3:
                saved = {k: v.clone() for k, v in model.state_dict().items()}
                state = opt.state_dict()
                model = tiny_model()
                model.load_state_dict(saved)
                opt = build_optimizer(model, train, "cpu")
                opt.load_state_dict(state)
            x = torch.randint(0, 11, (4, 8), generator=gen)
            _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach() for p in model.parameters()]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


def test_muon_never_imports_torch_dynamo() -> None:
    # torch._dynamo costs about 1 s of start-up; torch's Optimizer methods import it on their
    # first call, so Muon calls them unwrapped (llmcli.training.muon): a step, zero_grad and a
    # state_dict round trip must leave it unloaded, and the round trip must keep the state.
    code = (
        "import sys, torch\n"
        "from llmcli.config import TrainConfig\n"
        "from llmcli.model.gpt import Transformer\n"
        "from llmcli.config import ModelConfig\n"
        "from llmcli.training.optim import build_optimizer\n"
        "model = Transformer(ModelConfig(n_layer=1, n_head=2, n_embed=8, context_length=4), 5)\n"
        "opt = build_optimizer(model, TrainConfig(optimizer='muon'), 'cpu')\n"
        "x = torch.zeros(2, 4, dtype=torch.long)\n"
        "model(x, x)[1].backward()\n"
        "opt.step(); opt.zero_grad(set_to_none=True)\n"
        "first = opt.param_groups[0]['params'][0]  # a Muon matrix, index 0 in the state\n"
        "kept = opt.state[first]['momentum_buffer'].clone()\n"
        "opt.load_state_dict(opt.state_dict())\n"
        "assert kept.abs().sum() > 0 and torch.equal(opt.state[first]['momentum_buffer'], kept)\n"
        "print('DYNAMO', 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "DYNAMO False" in out.stdout, out.stdout + out.stderr
