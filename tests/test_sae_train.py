"""`llmcli.inspection.sae.train`: training on streamed activations, its files, exact resume, and the
refusals that keep a saved SAE safe."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import torch
from sae_helpers import HOOK, small_config, small_run, trained_sae

from llmcli.errors import InputError
from llmcli.inspection.sae import train as sae_train
from llmcli.inspection.sae.folder import CFG_FILE, METRICS_FILE, STATE_FILE, WEIGHTS_FILE, load_sae
from llmcli.inspection.sae.model import SparseAutoencoder, aux_reconstruction
from llmcli.inspection.sae.points import read_activations
from llmcli.inspection.sae.state import SAEState
from llmcli.inspection.sae.train import TrainOptions, lr_at, sae_step, train_sae
from llmcli.runs.loading import load_run
from llmcli.training.interrupt import Preempted

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    return small_run(tmp_path_factory.mktemp("run") / "run", small_corpus)


def test_a_training_writes_the_sae_its_metrics_and_its_resume_state(run, tmp_path) -> None:
    folder = trained_sae(run, tmp_path / "sae")
    assert {p.name for p in folder.iterdir()} >= {CFG_FILE, WEIGHTS_FILE, METRICS_FILE, STATE_FILE}
    records = [json.loads(line) for line in (folder / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6]
    assert all(r["l0"] <= 4 and 0 <= r["dead_fraction"] <= 1 for r in records)
    assert records[-1]["tokens"] == 6 * 128  # 128 activations: 8 windows of 16 tokens a step
    loaded = load_sae(folder)
    assert (loaded.info.hook, loaded.info.step, loaded.sae.d_sae) == (HOOK, 6, 64)
    assert torch.allclose(loaded.sae.W_dec.norm(dim=1), torch.ones(64))


def test_the_default_folder_is_in_the_run_and_the_width_sets_the_features(run) -> None:
    options = TrainOptions(checkpoint=run, device="cpu", overwrite=True)
    summary = train_sae(small_config(features=None, steps=1), options)
    assert summary.folder == run / "sae" / HOOK
    assert load_sae(summary.folder).sae.d_sae == 16 * 16  # 16 x n_embed


def test_a_resumed_training_ends_with_the_same_weights_bit_for_bit(
    run, tmp_path, monkeypatch
) -> None:
    straight = load_sae(trained_sae(run, tmp_path / "straight", steps=6)).sae
    real, calls = sae_train.BatchSampler.next, []

    def interrupted(self):  # Ctrl-C as the fifth step draws its windows: the step ends first
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self)

    monkeypatch.setattr(sae_train.BatchSampler, "next", interrupted)
    with pytest.raises(KeyboardInterrupt) as stopped:
        trained_sae(run, tmp_path / "half", steps=6)
    assert not isinstance(stopped.value, Preempted)  # Ctrl-C: exit 130, not SIGTERM's 143
    assert SAEState.load(tmp_path / "half" / STATE_FILE).step == 5  # saved at the Ctrl-C
    monkeypatch.undo()
    half = tmp_path / "half"
    train_sae(small_config(steps=6), TrainOptions(checkpoint=run, out=half, resume=True))
    resumed = load_sae(half).sae
    for name, tensor in straight.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
    # each record once: the first session's (steps 2 and 4), then the second's
    lines = (half / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4, 6]
    state = SAEState.load(half / STATE_FILE)
    assert (state.step, state.tokens) == (6, 6 * 128)


def test_a_resume_with_more_steps_goes_on_under_the_longer_schedule(run, tmp_path) -> None:
    # The first session's last step ran at its floor, 0; the steps added follow the new
    # schedule, so the weights are not a 6-step training's, and the step at lr 0 moved nothing
    # but Adam's moments.
    half = trained_sae(run, tmp_path / "half", steps=3)
    records = [json.loads(line) for line in (half / METRICS_FILE).read_text().splitlines()]
    assert [(r["step"], r["lr"]) for r in records] == [(2, 1e-3), (3, 0.0)]
    train_sae(small_config(steps=6), TrainOptions(checkpoint=run, out=half, resume=True))
    records = [json.loads(line) for line in (half / METRICS_FILE).read_text().splitlines()]
    assert [(r["step"], r["lr"]) for r in records] == [(2, 1e-3), (3, 0.0), (4, 1e-3), (6, 0.0)]
    assert SAEState.load(half / STATE_FILE).step == 6


def test_the_dead_features_are_counted_and_trained_by_auxk(run, tmp_path) -> None:
    """A feature that has not fired for `dead_tokens` tokens is counted dead; without AuxK a
    feature that never fired keeps its initial decoder row (TopK gives it no gradient), with
    AuxK it moves."""
    initial = SparseAutoencoder(16, 64, 1, generator=torch.Generator().manual_seed(0)).W_dec
    for aux_coef in (0.0, 1.0):
        folder = trained_sae(run, tmp_path / str(aux_coef), k=1, dead_tokens=128, aux_coef=aux_coef)
        state = SAEState.load(folder / STATE_FILE)
        records = [json.loads(line) for line in (folder / METRICS_FILE).read_text().splitlines()]
        dead = state.since_fired >= 128  # not fired in the last step of 128 tokens
        assert 0 < dead.sum() < 64
        assert records[-1]["dead_fraction"] == dead.float().mean().item()
        never = state.since_fired == state.tokens
        assert never.any()
        moved = ~torch.isclose(load_sae(folder).sae.W_dec[never], initial[never]).all(1)
        assert moved.all() if aux_coef else not moved.any()


def test_a_feature_silent_for_exactly_dead_tokens_is_trained_by_auxk_at_the_next_step(
    run, tmp_path
) -> None:
    """128 activations a step: with dead_tokens 128 a feature that did not fire in step 1 is
    dead in step 2, and AuxK moves its decoder row; with 129 it is not dead yet. (Step 3 runs
    at the schedule's last rate, 0, and moves nothing.)"""
    initial = SparseAutoencoder(16, 64, 1, generator=torch.Generator().manual_seed(0)).W_dec
    for dead_tokens, dead in ((128, True), (129, False)):
        folder = trained_sae(
            run, tmp_path / str(dead_tokens), k=1, steps=3, dead_tokens=dead_tokens, aux_coef=1.0
        )
        never = SAEState.load(folder / STATE_FILE).since_fired == 3 * 128
        assert never.any()
        moved = ~torch.isclose(load_sae(folder).sae.W_dec[never], initial[never]).all(1)
        assert moved.all() if dead else not moved.any()


def test_a_step_counts_only_positive_activations_as_active_and_fired() -> None:
    """TopK keeps each row's k largest pre-activations through a ReLU: a kept one that is 0 or
    below is not active (`l0`) and does not fire."""
    sae = SparseAutoencoder(4, 6, 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sae.W_enc.zero_()  # every row's pre-activations are b_enc
        sae.b_enc.copy_(torch.tensor([2.0, 1.0, 0.0, -1.0, -2.0, -3.0]))
    optimizer = torch.optim.Adam(sae.parameters())
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    no_dead = torch.zeros(6, dtype=torch.bool)
    figures = sae_step(sae, optimizer, x, no_dead, aux_coef=0.0, lr=1e-3)
    assert figures["l0"] == 2.0
    assert figures["fired"].tolist() == [True, True, False, False, False, False]


@pytest.mark.parametrize(("n_dead", "scale"), [(2, 2 / 8), (8, 1.0), (12, 1.0)])
def test_auxk_is_scaled_down_when_fewer_features_are_dead_than_it_uses(n_dead, scale) -> None:
    """AuxK reconstructs with the d_in / 2 = 8 largest dead features; with fewer dead, its loss
    is scaled by n_dead / 8 (Gao et al. 2024, appendix B.1, as EleutherAI's sparsify does). One
    plain SGD step of rate 1 moves `W_enc` by minus its gradient: with AuxK on, by that much
    more of the AuxK loss's gradient."""

    def fresh() -> SparseAutoencoder:
        return SparseAutoencoder(16, 64, 4, generator=torch.Generator().manual_seed(0))

    def step(aux_coef: float) -> torch.Tensor:
        sae = fresh()
        sae_step(sae, torch.optim.SGD(sae.parameters()), x, dead, aux_coef=aux_coef, lr=1.0)
        return sae.W_enc.detach()

    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    dead = torch.zeros(64, dtype=torch.bool)
    dead[-n_dead:] = True
    sae = fresh()
    pre = sae.pre_acts(x)  # (32, 64)
    residual = (x - sae.decode_sparse(*sae.select(pre), 32)).detach()  # (32, 16)
    aux = aux_reconstruction(sae, pre, dead, residual, min(8, n_dead)) - residual
    (grad,) = torch.autograd.grad(aux.pow(2).sum(-1).mean(), sae.W_enc)
    torch.testing.assert_close(step(1.0) - step(0.0), -scale * grad)


def test_the_sae_reads_the_activation_where_the_hook_point_is(run) -> None:
    model = load_run(run).model
    idx = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(0))
    seen = []
    with torch.no_grad(), model.hooks({"blocks.0.attn.z": seen.append}):
        model(idx)
    rows = read_activations(model, "blocks.0.attn.z", idx)
    assert rows.shape == (32, 16) and torch.equal(rows, seen[0].reshape(32, 16))


def test_the_learning_rate_decays_to_zero_at_the_last_step_over_the_last_fifth() -> None:
    config = small_config(steps=10, lr=1.0)  # a fifth: steps 8 and 9
    assert [lr_at(config, s) for s in range(10)] == [1.0] * 8 + [1.0, 0.0]
    config = small_config(steps=100, lr=2e-3)  # a fifth: steps 80..99
    assert lr_at(config, 79) == lr_at(config, 80) == 2e-3  # the first decay step: the peak
    assert lr_at(config, 81) == pytest.approx(2e-3 * 18 / 19)
    assert lr_at(config, 98) == pytest.approx(2e-3 / 19)
    assert lr_at(config, 99) == 0.0  # the last step: the floor the docs give


@pytest.mark.parametrize(
    ("options", "settings", "words"),
    [
        ({}, {}, "already holds an SAE"),
        ({"resume": True}, {"k": 3}, r"--k 4 \(now 3\)"),
        ({"resume": True}, {"steps": 2}, r"--steps \(2\) is below the 6 steps"),
        ({"resume": True, "overwrite": True}, {}, "give one of them"),
    ],
)
def test_a_saved_sae_is_not_overwritten_or_resumed_with_other_settings(
    run, tmp_path, options, settings, words
) -> None:
    folder = trained_sae(run, tmp_path / "sae")
    with pytest.raises(InputError, match=words):
        train_sae(small_config(**settings), TrainOptions(checkpoint=run, out=folder, **options))


def test_a_bad_hook_point_is_named_with_the_close_ones(run, tmp_path) -> None:
    options = TrainOptions(checkpoint=run, out=tmp_path / "x")
    with pytest.raises(InputError, match="did you mean blocks.1.resid_post"):
        train_sae(small_config(hook="blocks.1.resid_pots"), options)
    with pytest.raises(InputError, match="attention weights"):
        train_sae(small_config(hook="blocks.0.attn.pattern"), options)
    with pytest.raises(InputError, match="no state.pt to go on from"):
        train_sae(small_config(), TrainOptions(checkpoint=run, out=tmp_path / "y", resume=True))


def test_sigterm_saves_at_the_end_of_the_step_and_stops_as_preempted(
    run, tmp_path, monkeypatch
) -> None:
    real, calls = sae_train.sae_step, []

    def step(*args, **kwargs):  # SIGTERM in the middle of the third step's update
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(sae_train, "sae_step", step)
    with pytest.raises(Preempted):
        trained_sae(run, tmp_path / "sae", steps=6)
    state = SAEState.load(tmp_path / "sae" / STATE_FILE)
    assert (state.step, state.tokens) == (3, 3 * 128)


@pytest.mark.slow
def test_ctrl_c_on_a_terminal_shows_its_notice_on_a_line_of_its_own(run, tmp_path) -> None:
    from terminal_helpers import CTRL_C, Terminal

    args = ["llmcli", "sae", "train", "--checkpoint", str(run), "--hook", HOOK, "--steps",
            "100000", "--batch-tokens", "64", "--out", str(tmp_path / "sae")]  # fmt: skip
    term = Terminal(args, columns=80)
    term.wait_until(lambda: re.search(r"\| *[1-9]\d*/100000 \[", term.text()))  # stepping
    term.press(CTRL_C)
    notice = "SIGINT: saving a checkpoint after this step (Ctrl-C again quits at once"
    term.wait_until(lambda: any(line.startswith(notice) for line in term.lines()), 60)
    assert term.wait(120) == 130, term.lines()
    assert "stopped at step " in term.text().split(notice)[-1], term.lines()
