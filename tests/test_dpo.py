"""The DPO maths against formulas written out: NumPy for the values, plain torch ops for one
step's gradients, and TRL's own log-softmax."""

import numpy as np
import pytest
import torch
from model_helpers import assert_close, gen, randomize_, tiny_model

from llmcli.config import ModelConfig
from llmcli.config.objective_settings import DPO_LOSS_TYPES
from llmcli.model.gpt import Transformer
from llmcli.objectives.dpo import dpo_step
from llmcli.objectives.dpo_losses import LOSSES, DPOLoss, dpo_loss
from llmcli.objectives.preference_scores import (
    CompletionScores,
    completion_logps,
    sequence_logps,
)

BETA = 0.1
SIGMOID = DPOLoss(BETA)
TRL_NAMES = {
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
}


def scored(logps, tokens=None, logits=None) -> CompletionScores:
    """Scores of replies given their summed log-probabilities (one token each by default)."""
    logps = torch.as_tensor(logps)
    ones = torch.ones(logps.shape, dtype=torch.float64)
    return CompletionScores(
        logps,
        ones if tokens is None else torch.as_tensor(tokens, dtype=torch.float64),
        ones if logits is None else torch.as_tensor(logits, dtype=torch.float64),
    )


def numpy_sequence_logps(logits: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Position by position: log softmax of the logits before each completion token, at it."""
    out = np.zeros(len(ids))
    for b in range(len(ids)):
        for t in range(1, ids.shape[1]):
            if mask[b, t]:
                row = logits[b, t - 1].astype(np.float64)
                out[b] += row[ids[b, t]] - (np.log(np.exp(row - row.max()).sum()) + row.max())
    return out


def test_sequence_logps_sums_the_completion_tokens_only():
    g = gen(0)
    logits = torch.randn(3, 6, 11, generator=g) * 3
    ids = torch.randint(0, 11, (3, 6), generator=g)
    mask = torch.tensor(
        [
            [0, 0, 1, 1, 1, 1],
            [0, 1, 1, 0, 0, 0],  # then padding, left out
            [1, 1, 1, 1, 1, 1],  # a first token is never scored: nothing predicts it
        ],
        dtype=torch.bool,
    )
    expected = numpy_sequence_logps(logits.numpy(), ids.numpy(), mask.numpy())
    got = sequence_logps(logits, ids, mask)
    assert got.shape == (3,) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-5)
    # Garbage logits on padding positions change nothing.
    logits[1, 3:] = float("nan")
    np.testing.assert_allclose(sequence_logps(logits, ids, mask)[1].item(), expected[1], rtol=1e-6)


def test_the_loss_and_metrics_equal_the_formula():
    pc = np.array([-12.0, -30.5, -7.25, -4.0])
    pr = np.array([-15.0, -28.0, -7.25, -9.5])
    rc = np.array([-13.0, -29.0, -7.0, -5.0])
    rr = np.array([-14.0, -29.0, -7.5, -8.5])  # the third pair ties: no accuracy for it
    tc, tr = np.array([3.0, 5.0, 1.0, 2.0]), np.array([2.0, 4.0, 1.0, 6.0])  # tokens
    lc, lr = np.array([0.5, -1.0, 2.0, 0.25]), np.array([1.0, 0.0, -3.0, 4.0])  # logit sums
    loss, metrics = dpo_loss(
        scored(pc, tc, lc), scored(pr, tr, lr), torch.tensor(rc), torch.tensor(rr), SIGMOID
    )

    z = BETA * ((pc - rc) - (pr - rr))
    np.testing.assert_allclose(loss.item(), np.mean(np.logaddexp(0.0, -z)), rtol=1e-12)
    chosen, rejected = BETA * (pc - rc), BETA * (pr - rr)
    expected = {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": 0.5,  # pairs 1 and 4; pair 3's rewards are equal
        "rewards/margins": (chosen - rejected).mean(),
        "logps/chosen": pc.mean(),
        "logps/rejected": pr.mean(),
        "logits/chosen": lc.sum() / tc.sum(),  # TRL's: over all the batch's chosen tokens
        "logits/rejected": lr.sum() / tr.sum(),
    }
    assert set(metrics) == TRL_NAMES
    for name, value in expected.items():
        np.testing.assert_allclose(metrics[name].item(), value, rtol=1e-12, err_msg=name)
        assert not metrics[name].requires_grad


def test_a_list_of_loss_types_is_their_weighted_sum():
    assert list(LOSSES) == list(DPO_LOSS_TYPES)  # a formula for every name the config takes
    g = gen(6)
    pc, pr, rc, rr = (-20 * torch.rand(5, generator=g, dtype=torch.float64) for _ in range(4))
    chosen = scored(pc, [3, 5, 1, 2, 7], torch.randn(5, generator=g, dtype=torch.float64))
    rejected = scored(pr, [2, 4, 1, 6, 3], torch.randn(5, generator=g, dtype=torch.float64))

    def loss(types: tuple[str, ...], weights: tuple[float, ...] | None = None) -> float:
        settings = DPOLoss(0.5, types, weights, label_smoothing=0.1)
        return dpo_loss(chosen, rejected, rc, rr, settings)[0].item()

    each = {name: loss((name,)) for name in DPO_LOSS_TYPES}
    assert len(set(each.values())) == len(each)  # fourteen different losses
    mpo = 0.8 * each["sigmoid"] + 0.2 * each["bco_pair"] + each["sft"]
    assert loss(("sigmoid", "bco_pair", "sft"), (0.8, 0.2, 1.0)) == pytest.approx(mpo, rel=1e-12)
    assert loss(("sigmoid", "sft")) == pytest.approx(each["sigmoid"] + each["sft"], rel=1e-12)
    # sft: the chosen replies' negative log-likelihood per token over the batch
    assert each["sft"] == pytest.approx(-pc.sum().item() / 18, rel=1e-12)


def test_the_gradient_on_the_scores_is_the_formulas():
    # d/d(policy_chosen) of mean(-logsigmoid(beta * delta)) = -beta * sigmoid(-beta * delta) / B
    scores = [torch.tensor(x, requires_grad=True) for x in ([-3.0, -8.0], [-5.0, -2.0])]
    ref = [torch.tensor([-4.0, -7.0], requires_grad=True), torch.tensor([-4.5, -3.0])]
    loss, _ = dpo_loss(scored(scores[0]), scored(scores[1]), *ref, SIGMOID)
    loss.backward()
    delta = np.array([(-3 + 4) - (-5 + 4.5), (-8 + 7) - (-2 + 3)])
    pull = BETA / (1 + np.exp(BETA * delta)) / 2
    np.testing.assert_allclose(scores[0].grad.numpy(), -pull, rtol=1e-6)
    np.testing.assert_allclose(scores[1].grad.numpy(), pull, rtol=1e-6)
    assert ref[0].grad is None  # the reference is frozen


def test_one_steps_gradients_equal_the_loss_written_out_by_hand():
    policy = randomize_(tiny_model(vocab_size=13), seed=1)
    reference = randomize_(tiny_model(vocab_size=13), seed=2)
    # Two pairs; rows are [chosen..., rejected...], each a prompt, a completion, then padding.
    ids = torch.randint(0, 13, (4, 9), generator=gen(3))
    mask = torch.zeros(4, 9, dtype=torch.bool)
    for row, (start, end) in enumerate([(3, 9), (2, 5), (3, 6), (4, 8)]):
        mask[row, start:end] = True

    logits, _ = policy(ids)
    with torch.no_grad():
        ref_logits, _ = reference(ids)
    logps = sequence_logps(logits, ids, mask)
    ref_logps = sequence_logps(ref_logits, ids, mask)
    loss, _ = dpo_loss(scored(logps[:2]), scored(logps[2:]), ref_logps[:2], ref_logps[2:], SIGMOID)
    got = torch.autograd.grad(loss, list(policy.parameters()))

    def score(logits: torch.Tensor, b: int) -> torch.Tensor:
        """Row b's completion log-probability, one token at a time."""
        total = logits.new_zeros(())
        for t in range(1, 9):
            if mask[b, t]:
                row = logits[b, t - 1]
                total = total + row[ids[b, t]] - torch.log(torch.exp(row).sum())
        return total

    def by_hand(logits: torch.Tensor) -> torch.Tensor:
        losses = []
        for chosen, rejected in [(0, 2), (1, 3)]:
            chosen_ratio = score(logits, chosen) - score(ref_logits, chosen)
            rejected_ratio = score(logits, rejected) - score(ref_logits, rejected)
            z = BETA * (chosen_ratio - rejected_ratio)
            losses.append(-torch.log(1 / (1 + torch.exp(-z))))
        return (losses[0] + losses[1]) / 2

    logits, _ = policy(ids)
    expected_loss = by_hand(logits)
    assert_close(loss, expected_loss, "loss", atol=1e-6, rtol=1e-6)
    expected = torch.autograd.grad(expected_loss, list(policy.parameters()))
    for (name, _), g, e in zip(policy.named_parameters(), got, expected, strict=True):
        assert_close(g, e, name, atol=1e-6, rtol=1e-5)
    assert any(g.abs().max() > 0 for g in got)


def test_sequence_logps_equals_trls_log_softmax():
    from trl.trainer import utils  # in the test extra

    g = gen(4)
    logits = torch.randn(2, 7, 19, generator=g)
    ids = torch.randint(0, 19, (2, 7), generator=g)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    # TRL's DPOTrainer: per-token log-probabilities of the shifted labels, summed where the
    # shifted completion mask is set.
    per_token = utils.selective_log_softmax(logits[:, :-1], ids[:, 1:])
    expected = (per_token * mask[:, 1:]).sum(dim=1)
    assert_close(sequence_logps(logits, ids, mask), expected, "logps", atol=1e-6, rtol=1e-6)


def test_dpo_step_scores_rows_of_t_plus_1_tokens_and_trains_the_policy_only():
    policy = randomize_(tiny_model(vocab_size=13), seed=1)  # context_length 16
    reference = randomize_(tiny_model(vocab_size=13), seed=2)
    # Two pairs as the preference sampler gives them: (2B, T+1), chosen rows then rejected.
    ids = torch.randint(0, 13, (4, 17), generator=gen(4))
    mask = torch.zeros(4, 17, dtype=torch.bool)
    for row, (start, end) in enumerate([(3, 17), (2, 9), (3, 12), (4, 17)]):
        mask[row, start:end] = True

    loss, metrics = dpo_step(policy, reference, ids, mask, SIGMOID)
    # The models read T tokens; causal, so the logits on them are the full rows' but the last,
    # which scores nothing: sequence_logps on (logits of the first T, then one unused row).
    logits, _ = policy(ids[:, :-1])
    with torch.no_grad():
        ref_logits, _ = reference(ids[:, :-1])
    pad = lambda t: torch.cat([t, t[:, -1:]], dim=1)  # noqa: E731  (B, T+1, V)
    logps = sequence_logps(pad(logits), ids, mask)
    ref_logps = sequence_logps(pad(ref_logits), ids, mask)
    tokens = mask[:, 1:].sum(dim=1)  # (2B,): the completion tokens scored
    logit_sums = (logits.detach().mean(dim=-1) * mask[:, 1:]).sum(dim=1)  # (2B,)
    chosen, rejected = (scored(logps[k], tokens[k], logit_sums[k]) for k in (slice(2), slice(2, 4)))
    expected, expected_metrics = dpo_loss(chosen, rejected, ref_logps[:2], ref_logps[2:], SIGMOID)
    assert_close(loss, expected, "loss", atol=1e-6, rtol=1e-6)
    for name, value in expected_metrics.items():
        assert_close(metrics[name], value, name, atol=1e-6, rtol=1e-6)

    loss.backward()
    assert all(p.grad is not None for p in policy.parameters())
    assert all(p.grad is None for p in reference.parameters())


def test_dpo_step_from_the_reference_itself_is_log_2_with_no_reward():
    policy = randomize_(tiny_model(vocab_size=13), seed=1)
    ids = torch.randint(0, 13, (2, 17), generator=gen(5))
    mask = torch.zeros(2, 17, dtype=torch.bool)
    mask[:, 5:] = True
    loss, metrics = dpo_step(policy, policy, ids, mask, SIGMOID)
    assert_close(loss, torch.tensor(np.log(2.0), dtype=torch.float32), "loss")
    assert metrics["rewards/margins"] == 0 and metrics["rewards/accuracies"] == 0


def test_a_batch_cut_to_its_longest_pair_scores_as_one_padded_to_the_context() -> None:
    """Mixed lengths: the rows the sampler now cuts to the batch's longest give the same
    log-probabilities, loss and gradients as the same pairs padded to the whole context."""
    torch.manual_seed(0)
    config = ModelConfig(n_layer=1, n_head=2, n_embed=16, context_length=32, dropout=0.0)
    model = Transformer(config, 40)
    lengths = [7, 12, 19, 9]  # a row's tokens; its completion the last 4
    ids = torch.full((4, 33), 0, dtype=torch.long)
    mask = torch.zeros(4, 33, dtype=torch.bool)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(1, 40, (n,))
        mask[row, n - 4 : n] = True
    cut = max(lengths)
    full = completion_logps(model, ids, mask)
    (full.sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    short = completion_logps(model, ids[:, :cut], mask[:, :cut])
    short.sum().backward()
    torch.testing.assert_close(short, full, rtol=0, atol=1e-6)
    for got, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, got, rtol=1e-5, atol=1e-6)
