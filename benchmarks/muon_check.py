"""llmcli's Muon against `torch.optim.Muon` + `torch.optim.AdamW` on the speedrun model; JSON.

The issue: torch (>= 2.9) ships `torch.optim.Muon` with the same Nesterov momentum, quintic
Newton-Schulz coefficients and `sqrt(max(1, rows/cols))` scale as `llmcli.training.muon`, so
could the speedrun use it (beside `torch.optim.AdamW` for the other groups) instead? torch's
Newton-Schulz casts each update to bfloat16 and works on one matrix at a time; llmcli's works in
float32 on stacks of same-shaped matrices, on Gram matrices for wide ones. This measures what
that means on `configs/speedrun-cpu.yaml`'s model (its shapes, groups and hyperparameters):

- `speed`: ms per optimizer step (gradients fixed, from one real backward), interleaved rounds
  in one process on one thread, medians over rounds. `llmcli` is `build_optimizer` (what
  `train.optimizer: muon` runs); `torch` is `torch.optim.Muon` (hidden matrices,
  `adjust_lr_fn="original"`, weight decay 0 as llmcli's Muon group) plus `torch.optim.AdamW`
  (fused, the rest). The parts are timed alone too: each Muon on the hidden matrices only, and
  the AdamW groups in llmcli's optimizer against `torch.optim.AdamW` (fused and foreach).
- `training`: both set-ups trained from the same weights on the same batches of the corpus (the
  recipe's schedule, clipping at `train.grad_clip`): after 1, 10 and 50 steps the largest
  absolute weight difference (hidden matrices and the rest apart), each one's training loss and
  its loss on 8 fixed validation batches.
- `newton_schulz`: on the first step's hidden-matrix updates, the relative Frobenius difference
  of torch's bfloat16 iteration from llmcli's float32 one.

Usage: OMP_NUM_THREADS=1 python benchmarks/muon_check.py [--rounds 15] [--steps 20]
       [--train-steps 50]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmcli.config import Config, load_config  # noqa: E402
from llmcli.data.tokenizer import CharTokenizer  # noqa: E402
from llmcli.model.gpt import Transformer  # noqa: E402
from llmcli.training.muon import AdamWDefaults, Muon, muon_param_groups, newton_schulz  # noqa: E402
from llmcli.training.optim import apply_lr, build_optimizer, param_groups  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
Step = Callable[[], None]


def llmcli_groups(model: nn.Module, train: Any) -> list[dict[str, Any]]:
    """llmcli's Muon groups for `model`, as `build_optimizer` makes them."""
    return muon_param_groups(model, train, param_groups(model, train.weight_decay))


def torch_pair(model: nn.Module, cfg: Config) -> list[torch.optim.Optimizer]:
    """`torch.optim.Muon` for the hidden matrices, fused `torch.optim.AdamW` for the rest."""
    train = cfg.train
    hidden, *rest = llmcli_groups(model, train)
    muon = torch.optim.Muon(
        [{k: v for k, v in hidden.items() if k != "use_muon"}],
        lr=train.muon_lr,
        weight_decay=0.0,
        momentum=train.muon_momentum,
        nesterov=True,
        adjust_lr_fn="original",
    )
    adamw = torch.optim.AdamW(
        [{k: v for k, v in g.items() if k != "use_muon"} for g in rest],
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        eps=1e-8,
        fused=True,
    )
    return [muon, adamw]


def llmcli_part(model: nn.Module, cfg: Config, muon: bool) -> Muon:
    """llmcli's Muon over only its Muon group (`muon`) or only its AdamW groups."""
    groups = [g for g in llmcli_groups(model, cfg.train) if g["use_muon"] is muon]
    adamw = AdamWDefaults(betas=(cfg.train.beta1, cfg.train.beta2), eps=1e-8)
    return Muon(groups, momentum=cfg.train.muon_momentum, adamw=adamw)


def stepper(optimizers: list[torch.optim.Optimizer]) -> Step:
    def step() -> None:
        for opt in optimizers:
            opt.step()

    return step


def fill_grads(model: nn.Module, x: Tensor, y: Tensor) -> None:
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()


def speed(model: nn.Module, cfg: Config, x: Tensor, y: Tensor, rounds: int, steps: int) -> dict:
    """Median ms per step of each contestant, rounds interleaved, the order rotating."""
    models = {}
    contestants: dict[str, Step] = {}

    def add(name: str, make: Callable[[nn.Module], list[torch.optim.Optimizer]]) -> None:
        m = copy.deepcopy(model)
        fill_grads(m, x, y)
        models[name] = m
        contestants[name] = stepper(make(m))

    hidden_names = set(llmcli_groups(model, cfg.train)[0]["names"])

    def torch_adamw(m: nn.Module, **kernel: Any) -> list[torch.optim.Optimizer]:
        rest = [
            {k: v for k, v in g.items() if k != "use_muon"} for g in llmcli_groups(m, cfg.train)[1:]
        ]
        betas = (cfg.train.beta1, cfg.train.beta2)
        return [torch.optim.AdamW(rest, lr=cfg.train.lr, betas=betas, eps=1e-8, **kernel)]

    add("llmcli", lambda m: [build_optimizer(m, cfg.train, "cpu")])
    add("torch", lambda m: torch_pair(m, cfg))
    add("llmcli_muon_only", lambda m: [llmcli_part(m, cfg, muon=True)])
    add("torch_muon_only", lambda m: torch_pair(m, cfg)[:1])
    add("llmcli_adamw_groups", lambda m: [llmcli_part(m, cfg, muon=False)])
    add("torch_adamw_fused", lambda m: torch_adamw(m, fused=True))
    add("torch_adamw_foreach", lambda m: torch_adamw(m, foreach=True))
    assert hidden_names  # the speedrun has hidden matrices
    names = list(contestants)
    for step in contestants.values():  # warm up: state allocated, kernels chosen
        step()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            for _ in range(steps):
                contestants[name]()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "ms_per_step_median": {k: round(v, 3) for k, v in med.items()},
        "ms_per_step_min": {k: round(min(t), 3) for k, t in times.items()},
        "ratio_torch_over_llmcli": round(med["torch"] / med["llmcli"], 2),
        "ratio_muon_only_torch_over_llmcli": round(
            med["torch_muon_only"] / med["llmcli_muon_only"], 2
        ),
        "ratio_adamw_fused_over_llmcli_adamw_groups": round(
            med["torch_adamw_fused"] / med["llmcli_adamw_groups"], 2
        ),
    }


def speed_without_onednn(model: nn.Module, cfg: Config, x: Tensor, y: Tensor) -> dict:
    """The Muon parts alone with oneDNN off: bfloat16 matmuls then take the path of a CPU
    without native bf16 support (the AVX2 machines of RESULTS.md), fp32 ones stay on MKL."""
    steps = {}
    for name, make in (
        ("llmcli_muon_only", lambda m: [llmcli_part(m, cfg, muon=True)]),
        ("torch_muon_only", lambda m: torch_pair(m, cfg)[:1]),
    ):
        m = copy.deepcopy(model)
        fill_grads(m, x, y)
        steps[name] = (m, stepper(make(m)))
    times: dict[str, list[float]] = {name: [] for name in steps}
    with torch.backends.mkldnn.flags(enabled=False):
        for r in range(5):
            for name in list(steps)[r % 2 :] + list(steps)[: r % 2]:
                t0 = time.perf_counter()
                for _ in range(2):
                    steps[name][1]()
                times[name].append((time.perf_counter() - t0) / 2 * 1e3)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "ms_per_step_median": {k: round(v, 3) for k, v in med.items()},
        "ratio_torch_over_llmcli": round(med["torch_muon_only"] / med["llmcli_muon_only"], 2),
    }


def batches(ids: Tensor, n: int, cfg: Config, gen: torch.Generator) -> list[tuple[Tensor, Tensor]]:
    T, B = cfg.model.context_length, cfg.train.batch_size
    out = []
    for _ in range(n):
        start = torch.randint(0, len(ids) - T - 1, (B,), generator=gen)
        x = torch.stack([ids[s : s + T] for s in start.tolist()])  # (B, T)
        y = torch.stack([ids[s + 1 : s + T + 1] for s in start.tolist()])  # (B, T)
        out.append((x, y))
    return out


@torch.no_grad()
def val_loss(model: nn.Module, val: list[tuple[Tensor, Tensor]]) -> float:
    return statistics.fmean(model(x, y)[1].item() for x, y in val)


def training(
    model: nn.Module, cfg: Config, train_ids: Tensor, val_ids: Tensor, n_steps: int
) -> list[dict]:
    """Both set-ups from the same weights on the same batches; figures at steps 1, 10, 50."""
    gen = torch.Generator().manual_seed(1)
    data = batches(train_ids, n_steps, cfg, gen)
    val = batches(val_ids, 8, cfg, gen)
    runs = {}
    for name in ("llmcli", "torch"):
        m = copy.deepcopy(model)
        opts = [build_optimizer(m, cfg.train, "cpu")] if name == "llmcli" else torch_pair(m, cfg)
        runs[name] = (m, opts)
    hidden = set(llmcli_groups(model, cfg.train)[0]["names"])
    report = []
    for step, (x, y) in enumerate(data):
        losses = {}
        for name, (m, opts) in runs.items():
            for opt in opts:
                apply_lr(opt, step, cfg.train)
            _, loss = m(x, y)
            loss.backward()
            nn.utils.clip_grad_norm_(m.parameters(), cfg.train.grad_clip, foreach=True)
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses[name] = loss.item()
        if step + 1 in (1, 10, 50, n_steps):  # n_steps: the recipe's 300, its whole run
            a = dict(runs["llmcli"][0].named_parameters())
            b = dict(runs["torch"][0].named_parameters())
            diff = {n: (a[n] - b[n]).abs().max().item() for n in a}
            report.append(
                {
                    "step": step + 1,
                    "max_abs_weight_diff_hidden": max(v for n, v in diff.items() if n in hidden),
                    "max_abs_weight_diff_rest": max(
                        (v for n, v in diff.items() if n not in hidden), default=0.0
                    ),
                    "train_loss": {k: round(v, 4) for k, v in losses.items()},
                    "val_loss": {k: round(val_loss(r[0], val), 4) for k, r in runs.items()},
                }
            )
    return report


def ns_difference(model: nn.Module, cfg: Config, x: Tensor, y: Tensor) -> dict:
    """torch's bf16 Newton-Schulz against llmcli's fp32 one, on the first Nesterov updates."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    m = copy.deepcopy(model)
    fill_grads(m, x, y)
    mu = cfg.train.muon_momentum
    rel = []
    for p in llmcli_groups(m, cfg.train)[0]["params"]:
        update = p.grad.lerp(p.grad * (1 - mu), mu)  # (1 - mu) G + mu M with M = (1 - mu) G
        ours = newton_schulz(update)
        theirs = _zeropower_via_newtonschulz(update, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
        rel.append(((theirs - ours).norm() / ours.norm()).item())
    return {"relative_frobenius_diff_max": max(rel), "median": statistics.median(rel)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per round")
    parser.add_argument(
        "--train-steps", type=int, default=300, help="steps of the training check (max_steps)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config("speedrun-cpu")
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    tok = CharTokenizer.train([text])
    ids = torch.from_numpy(tok.encode_array(text)).long()
    cut = int(len(ids) * (1 - cfg.data.val_fraction))
    model = Transformer(cfg.model, tok.vocab_size, generator=torch.Generator().manual_seed(0))
    x, y = batches(ids[:cut], 1, cfg, torch.Generator().manual_seed(0))[0]
    t0 = time.perf_counter()
    result = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": {k: getattr(cfg.model, k) for k in ("n_layer", "n_head", "n_embed")},
        "hidden_shapes": sorted(
            {tuple(p.shape) for p in llmcli_groups(model, cfg.train)[0]["params"]}
        ),
        "bf16_matmul_native": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        "speed": speed(model, cfg, x, y, args.rounds, args.steps),
        "speed_without_native_bf16": speed_without_onednn(model, cfg, x, y),
        "newton_schulz": ns_difference(model, cfg, x, y),
        "training": training(model, cfg, ids[:cut], ids[cut:], args.train_steps),
    }
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
