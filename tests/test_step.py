"""One training step (llmcli/training/step.py): `train_step` against the plain loop written out
(micro-batches, backward, clip, step, zero_grad), loss scaling, and a refused update."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmcli.training.precision import Precision
from llmcli.training.step import Trainer, all_of, train_step


class Batches:
    """The given `(x, y)` pairs, in order."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs, self.i = pairs, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.i += 1
        return self.pairs[self.i - 1]


class Regression(nn.Module):
    """A tiny model with the `(logits, loss) = model(x, y)` interface of `Transformer`."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(x)
        return out, nn.functional.mse_loss(out, y)


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)) for _ in range(n)
    ]


def trainer(model: nn.Module, pairs, grad_accum: int, clip: float, precision=None) -> Trainer:
    return Trainer(
        model=model,
        params=list(model.parameters()),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        precision=precision or Precision.resolve(torch.device("cpu"), "float32"),
        batches=Batches(pairs),
        grad_accum=grad_accum,
        grad_clip=clip,
    )


def plain_step(model: nn.Module, optimizer, pairs, clip: float) -> tuple[float, float]:
    """nanoGPT's loop body, written out: the reference."""
    total = 0.0
    for x, y in pairs:
        _, loss = model(x, y)
        loss = loss / len(pairs)
        loss.backward()
        total += loss.item()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    if clip > 0:
        for p in model.parameters():
            p.grad.mul_(min(1.0, clip / (norm.item() + 1e-6)))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, norm.item()


@pytest.mark.parametrize(("grad_accum", "clip"), [(1, 0.0), (3, 0.0), (3, 0.5)])
def test_train_step_is_the_plain_loop(grad_accum: int, clip: float) -> None:
    pairs = batches(2 * grad_accum)
    ours, ref = Regression(0), Regression(0)
    t = trainer(ours, pairs, grad_accum, clip)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):  # momentum: the second step depends on the first
        loss, norm, applied, _ = train_step(t)
        ref_loss, ref_norm = plain_step(ref, ref_opt, pairs[step * grad_accum :][:grad_accum], clip)
        assert applied
        torch.testing.assert_close(loss.item(), ref_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(norm.item(), ref_norm, rtol=1e-5, atol=1e-6)  # before clipping
        if clip > 0:
            assert ref_norm > clip  # the clipping path is taken
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            assert a.grad is None  # zeroed (set to None) after the step


def test_a_refused_update_changes_nothing_but_drops_the_gradients() -> None:
    model = Regression(0)
    t = trainer(model, batches(4), 2, 1.0)
    train_step(t)  # momentum buffers exist now
    weights = [p.detach().clone() for p in model.parameters()]
    moments = {k: v["momentum_buffer"].clone() for k, v in t.optimizer.state.items()}
    seen = []
    loss, norm, applied, _ = train_step(t, lambda loss, norm: seen.append((loss, norm)) or False)
    assert not applied and len(seen) == 1
    assert seen[0][0] is loss and seen[0][1] is norm  # what the guard judged is what it returns
    for p, w in zip(model.parameters(), weights, strict=True):
        assert torch.equal(p, w) and p.grad is None
    for k, v in t.optimizer.state.items():
        assert torch.equal(v["momentum_buffer"], moments[k])


def test_a_scaled_loss_gives_the_step_of_the_unscaled_one() -> None:
    # fp16's GradScaler on the CPU (float32 maths): a power-of-two scale is undone exactly.
    cpu = torch.device("cpu")
    scaled = Precision("float16", cpu, None, torch.amp.GradScaler("cpu", init_scale=2.0**10))
    ours, ref = Regression(0), Regression(0)
    pairs = batches(2)
    t_ours, t_ref = trainer(ours, pairs, 2, 0.5, scaled), trainer(ref, pairs, 2, 0.5)
    loss, norm, _, _ = train_step(t_ours)
    ref_loss, ref_norm, _, _ = train_step(t_ref)
    assert scaled.scales_loss and scaled.scaler.get_scale() == 2.0**10  # no overflow: kept
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(norm, ref_norm)  # the true norm, unscaled before it is taken
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_an_overflowing_scaled_step_is_skipped_and_the_scale_lowered() -> None:
    cpu = torch.device("cpu")
    scaled = Precision("float16", cpu, None, torch.amp.GradScaler("cpu", init_scale=2.0**10))
    model = Regression(0)
    x, y = batches(1)[0]
    t = trainer(model, [(x * float("inf"), y)], 1, 0.0, scaled)
    weights = [p.detach().clone() for p in model.parameters()]
    _, _, applied, _ = train_step(t)
    assert applied  # the loop's verdict; the scaler itself skipped the update
    assert scaled.scaler.get_scale() == 2.0**9
    for p, w in zip(model.parameters(), weights, strict=True):
        assert torch.equal(p, w)


def test_forgetting_an_abandoned_step_keeps_the_scale() -> None:
    """After an out-of-memory error between `unscale_` and the update, the retried step must be
    able to unscale again: the scaler forgets the step, not its scale."""
    cpu = torch.device("cpu")
    precision = Precision("float16", cpu, None, torch.amp.GradScaler("cpu", init_scale=2.0**7))
    model = Regression(0)
    t = trainer(model, batches(2), 1, 0.0, precision)
    x, y = t.batches.next()
    precision.scaler.scale(model(x, y)[1]).backward()
    precision.scaler.unscale_(t.optimizer)  # ... and then the step ran out of memory
    precision.forget_step()
    t.optimizer.zero_grad(set_to_none=True)
    train_step(t)  # unscales again: no "unscale_() has already been called"
    assert precision.scaler.get_scale() == 2.0**7


def test_all_of_runs_the_checks_in_order_until_one_refuses() -> None:
    calls: list[str] = []

    def check(name: str, verdict: bool):
        def run(loss: torch.Tensor, norm: torch.Tensor) -> bool:
            calls.append(name)
            return verdict

        return run

    loss, norm = torch.tensor(1.0), torch.tensor(2.0)
    assert all_of(None, None) is None
    assert all_of(check("a", True), None, check("b", True))(loss, norm) is True
    assert all_of(check("c", False), check("d", True))(loss, norm) is False
    assert calls == ["a", "b", "c"]  # d is never asked once c refuses
