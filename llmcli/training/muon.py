"""Muon for the hidden matrices and torch's AdamW for the rest, in one optimizer.

Muon (Keller Jordan, 2024; https://kellerjordan.github.io/posts/muon/, the optimizer of the
KellerJordan/modded-nanogpt and karpathy/nanochat speedruns) runs SGD with Nesterov momentum on
each 2-D hidden weight matrix, then replaces the update by (approximately) the nearest
semi-orthogonal matrix: for an update with SVD `U S V^T` it applies `U V^T`, so every direction of
the update moves by the same amount however ill-conditioned the gradient is. The orthogonalisation
is a few steps of a quintic Newton-Schulz iteration, `X <- a X + (b A + c A^2) X` with
`A = X X^T`, whose coefficients `(3.4445, -4.7750, 2.0315)` push small singular values up fast;
after 5 steps the singular values lie roughly in [0.7, 1.2] instead of exactly at 1, which trains
as well (modded-nanogpt's note) and costs about 15 small matmuls per matrix (fewer, on Gram
matrices, for wide ones: see `newton_schulz`).

Embeddings, the LM head and every vector (norm gains, biases) are not hidden matrices: Muon's
argument (a linear map between hidden spaces, whose operator norm matters) does not hold for them,
and they go to AdamW, in the same optimizer object, as `use_muon=False` groups. One optimizer
keeps the training loop unchanged: one `step()`, one `state_dict()` to save and resume.

Update of a Muon group with learning rate `lr`, momentum `mu`, weight decay `wd`, for a
`(rows, cols)` matrix `W` with gradient `G` and momentum buffer `M` (zero at first):

    M <- mu * M + (1 - mu) * G
    U <- (1 - mu) * G + mu * M          (Nesterov; U <- M without it)
    W <- W * (1 - lr * wd) - lr * sqrt(max(1, rows / cols)) * NS(U)

The `sqrt(max(1, rows/cols))` factor keeps the per-element size of tall updates (a `(4C, C)` MLP
input, a `(3C, C)` fused QKV) in line with square ones (modded-nanogpt).

What is here and what is torch's. `torch.optim.Muon` (torch >= 2.9) has the same update with
`adjust_lr_fn="original"`, but its Newton-Schulz casts each update to bfloat16 and runs one
matrix at a time. On the speedrun-cpu model, without native bf16 matmuls (the AVX2 CPUs of
benchmarks/RESULTS.md) its Muon step is 20-24x slower than this float32 iteration on stacks of
same-shaped matrices; with them it is 5-8% faster, but bf16 moves each update by about 10%
(benchmarks/muon_check.py). So the Muon update stays here. The AdamW groups are torch's AdamW:
the function `torch.optim.AdamW.step` runs (`torch.optim.adamw.adamw`, its fused kernel on CPU
and CUDA), on state laid out as `torch.optim.AdamW` lays it out, so they step bit for bit as
`torch.optim.AdamW` does. The function rather than an inner `torch.optim.AdamW` object: that
class's methods import torch._dynamo (about 1.4 s, see `Muon`), and one optimizer needs one
state dict.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.adamw import adamw

from llmcli.config import TrainConfig
from llmcli.model.lora import ADAPTER_SUFFIXES

# Quintic Newton-Schulz coefficients of KellerJordan/modded-nanogpt: the largest slope at 0
# that still keeps every singular value within about [0.7, 1.2] after 5 steps.
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """Approximately orthogonalise `G` (its "zeroth power" `U V^T`) by Newton-Schulz iterations.

    The matrix is first scaled to Frobenius norm 1 (so every singular value is <= 1, where the
    iteration converges), worked on in its wide orientation `X_0` (`r x k`, `r <= k`), and
    computed in float32 whatever its dtype.

    Every iterate is `X_t = Q_t X_0` with an `r x r` matrix `Q_t`, since each step multiplies by
    a polynomial in `X_t X_t^T` on the left. For a clearly wide matrix (`k >= 2r`, an MLP's
    `(4C, C)` or a fused `(3C, C)` QKV) the iteration therefore runs on `r x r` matrices only:
    `S = X_0 X_0^T`, `A_t = Q_t S Q_t^T`, `Q_{t+1} = a Q_t + (b A_t + c A_t^2) Q_t`, then one
    `Q X_0` at the end. The result is the same up to rounding, and on a CPU 2-2.5x faster for
    4:1 matrices; square ones take the direct form.

    Args:
        G: `(..., m, n)`: one matrix or a stack of matrices, each orthogonalised on its own.
        steps: Newton-Schulz iterations (5 in modded-nanogpt and nanochat).
        eps: added to the norm, so a zero matrix stays zero.

    Returns:
        `(..., m, n)` in `G`'s dtype, with singular values near 1 (about 0.7 to 1.2 after 5 steps)
        and the singular vectors of `G`.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a stack of matrices, got {G.ndim}-D")
    a, b, c = NS_COEFFS
    X = G.float().reshape(-1, *G.shape[-2:])  # (s, m, n): one stack of s, for baddbmm
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT  # (s, n, m): the wide orientation
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)  # (s, r, k), r <= k
    r, k = X.shape[-2:]
    # `baddbmm(M, P, R, beta, alpha)` is `beta M + alpha P R` in one kernel: the polynomial's
    # scalings and sums cost no kernels of their own, which on small matrices cost as much as
    # a matmul (on the speedrun-cpu model, the iteration takes a fifth less time).
    if k >= 2 * r and steps > 0:
        S = X @ X.mT  # (s, r, k) @ (s, k, r) -> (s, r, r)
        Q = torch.baddbmm(S, S, S, beta=b, alpha=c)  # the first step, from Q_0 = I: (s, r, r)
        Q.diagonal(dim1=-2, dim2=-1).add_(a)  # + a I
        for _ in range(steps - 1):
            A = Q @ S @ Q.mT  # X_t X_t^T: (s, r, r)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2: (s, r, r)
            Q = torch.baddbmm(Q, B, Q, beta=a)  # a Q + B Q: (s, r, r)
        X = Q @ X  # (s, r, r) @ (s, r, k) -> (s, r, k)
    else:
        for _ in range(steps):
            A = X @ X.mT  # (s, r, k) @ (s, k, r) -> (s, r, r)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2: (s, r, r)
            X = torch.baddbmm(X, B, X, beta=a)  # a X + B X: (s, r, k)
    if tall:
        X = X.mT  # (s, m, n)
    return X.reshape(G.shape).to(G.dtype)


def _without_dynamo_guard(method: Any) -> Any:
    """A `torch.optim.Optimizer` method without its `torch._disable_dynamo` wrapper (see `Muon`)."""
    return getattr(method, "__wrapped__", method)


@dataclass(frozen=True)
class AdamWDefaults:
    """What a `Muon` AdamW group (`use_muon=False`) uses where it sets no value of its own.

    Attributes:
        lr: learning rate (`train.lr`).
        betas: `(beta1, beta2)`.
        eps: added to the denominator.
        fused: torch's fused AdamW kernel (CPU and CUDA have it); else its foreach kernel.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    fused: bool = True


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked `use_muon=True`, AdamW for the others, in one optimizer.

    Each param group is a dict with `params` and `use_muon`, plus its hyperparameters (missing
    ones take the constructor's defaults):
    - Muon groups (`use_muon=True`, 2-D parameters only): `lr`, `momentum`, `nesterov`,
      `ns_steps`, `weight_decay`;
    - AdamW groups: `lr`, `betas`, `eps`, `weight_decay`, `fused`.
    Extra keys (`names`, `base_lr`) are kept, as in any torch optimizer.

    Muon groups update same-shaped matrices together: their updates are stacked and
    orthogonalised in one batched Newton-Schulz call, which on small models saves most of the
    per-matrix overhead. AdamW groups are stepped by torch's AdamW (the module docstring):
    their state is `torch.optim.AdamW`'s (`step`, a 0-d tensor, `exp_avg`, `exp_avg_sq`), so
    `load_state_dict` puts `step` where the fused kernel needs it, as for `torch.optim.AdamW`.

    Args:
        params: the param groups (dicts as above).
        lr: default Muon learning rate (`train.muon_lr`).
        momentum: Muon momentum `mu`.
        nesterov: Nesterov momentum for Muon.
        ns_steps: Newton-Schulz iterations.
        weight_decay: default decoupled weight decay (both kinds).
        adamw: defaults of the AdamW groups.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        *,
        adamw: AdamWDefaults = AdamWDefaults(),
    ) -> None:
        groups = [dict(g) for g in params]
        for group in groups:
            if "use_muon" not in group:
                raise ValueError("every Muon param group needs a 'use_muon' key (True or False)")
            group["params"] = list(group["params"])
            if group["use_muon"]:
                for p in group["params"]:
                    if p.ndim != 2:
                        raise ValueError(
                            f"Muon groups take 2-D matrices only, got a {p.ndim}-D parameter of "
                            f"shape {tuple(p.shape)}: put it in a use_muon=False (AdamW) group"
                        )
                for key, value in (
                    ("lr", lr),
                    ("momentum", momentum),
                    ("nesterov", nesterov),
                    ("ns_steps", ns_steps),
                    ("weight_decay", weight_decay),
                ):
                    group.setdefault(key, value)
            else:
                for key, value in (
                    ("lr", adamw.lr),
                    ("betas", adamw.betas),
                    ("eps", adamw.eps),
                    ("weight_decay", weight_decay),
                    ("fused", adamw.fused),
                ):
                    group.setdefault(key, value)
        super().__init__(groups, {})

    # torch wraps these methods in `torch._disable_dynamo`, whose first call imports
    # torch._dynamo: about 1 s, a tenth of a 15 s speedrun, for a compiler that never runs here
    # (`train.compile` compiles the model, not the optimizer). Muon calls the methods themselves;
    # outside a compiled region the wrapper only forwards the call, so nothing else changes.
    add_param_group = _without_dynamo_guard(torch.optim.Optimizer.add_param_group)
    zero_grad = _without_dynamo_guard(torch.optim.Optimizer.zero_grad)
    state_dict = _without_dynamo_guard(torch.optim.Optimizer.state_dict)
    load_state_dict = _without_dynamo_guard(torch.optim.Optimizer.load_state_dict)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        by_shape: dict[tuple[int, ...], list[Tensor]] = defaultdict(list)
        for p in group["params"]:
            if p.grad is not None:
                by_shape[tuple(p.shape)].append(p)
        for (rows, cols), params in by_shape.items():
            grads = [p.grad for p in params]
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                bufs.append(state["momentum_buffer"])
            torch._foreach_lerp_(bufs, grads, 1 - mu)  # M <- mu M + (1 - mu) G
            if group["nesterov"]:
                updates = torch._foreach_lerp(grads, bufs, mu)  # (1 - mu) G + mu M
            else:
                updates = bufs
            stacked = torch.stack(updates)  # (n, rows, cols)
            ortho = newton_schulz(stacked, group["ns_steps"]).to(params[0].dtype)  # (n, rows, cols)
            if wd:
                torch._foreach_mul_(params, 1 - lr * wd)
            scale = math.sqrt(max(1.0, rows / cols))
            torch._foreach_add_(params, list(ortho.unbind(0)), alpha=-lr * scale)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        states = [self._adamw_state(p, group["fused"]) for p in params]
        beta1, beta2 = group["betas"]
        adamw(
            params,
            [p.grad for p in params],
            [state["exp_avg"] for state in states],
            [state["exp_avg_sq"] for state in states],
            [],  # max_exp_avg_sqs: amsgrad is off
            [state["step"] for state in states],
            foreach=not group["fused"],
            fused=group["fused"],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _adamw_state(self, p: Tensor, fused: bool) -> dict[str, Any]:
        """`p`'s AdamW state as `torch.optim.AdamW` makes it: zero moments, and the step count a
        float32 0-d tensor, on `p`'s device for the fused kernel, else on the CPU."""
        state = self.state[p]
        if "step" not in state:
            device = p.device if fused else torch.device("cpu")
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """What `load_state_dict` ends with; as `torch.optim.AdamW`'s, it brings older state
        dicts up to date. Saves of llmcli up to 5b00014 have AdamW groups without `fused` (then
        the foreach kernel, until a resume puts today's hyperparameters back) and int step
        counts (then float32 0-d tensors on the parameter's device, which both kernels take)."""
        super().__setstate__(state)
        for group in self.param_groups:
            if group["use_muon"]:
                continue
            group.setdefault("fused", False)
            for p in group["params"]:
                p_state = self.state.get(p, {})
                if "step" in p_state and not isinstance(p_state["step"], Tensor):
                    step = float(p_state["step"])
                    p_state["step"] = torch.tensor(step, dtype=torch.float32, device=p.device)


def muon_param_groups(
    model: nn.Module, train: TrainConfig, adamw_groups: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Muon's groups, from the AdamW ones (`llmcli.training.optim.param_groups`: the decayed
    matrices, then the vectors): the 2-D hidden weight matrices move to a Muon group.

    Hidden matrices are the 2-D parameters that are neither an `nn.Embedding` table nor the
    model's `lm_head` (attention QKV and output projections, MLP matrices), nor a LoRA
    adapter's. The embeddings, the LM head and the adapters stay with AdamW with weight decay,
    norm gains and biases with AdamW without.

    Returns:
        `[muon, adamw decay, adamw no-decay]` groups, each with `"names"` and `"base_lr"`.
    """
    skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    # LoRA's A (r, in) and B (out, r) stay with AdamW, as PEFT trains them: Muon's
    # orthogonalised step, scaled for a full matrix's shape and muon_lr, is untried on a factor
    # of rank r whose B starts at zero (`llmcli.model.lora`).
    skip |= {id(p) for n, p in model.named_parameters() if n.endswith(ADAPTER_SUFFIXES)}
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        skip.add(id(head.weight))
    decay, no_decay = adamw_groups
    named = list(zip(decay["names"], decay["params"], strict=True))
    hidden = [(n, p) for n, p in named if p.dim() == 2 and id(p) not in skip]
    kept = [(n, p) for n, p in named if not (p.dim() == 2 and id(p) not in skip)]
    adamw_options = {"use_muon": False, "lr": train.lr, "base_lr": train.lr}

    def group(items: list[tuple[str, Tensor]], **options: Any) -> dict[str, Any]:
        return {"params": [p for _, p in items], "names": [n for n, _ in items], **options}

    return [
        group(hidden, use_muon=True, lr=train.muon_lr, base_lr=train.muon_lr, weight_decay=0.0),
        group(kept, **adamw_options, weight_decay=train.weight_decay),
        {**no_decay, **adamw_options, "weight_decay": 0.0},
    ]
