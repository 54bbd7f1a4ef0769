"""The sparse autoencoder's maths against NumPy: encode, decode, TopK's count, BatchTopK, the
sparse decode training uses, AuxK, and the unit-norm decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_helpers import assert_close, gen
from sae_helpers import numpy_decode, numpy_encode

from llmcli.errors import InputError
from llmcli.inspection.sae.config import SAEConfig
from llmcli.inspection.sae.model import SparseAutoencoder, aux_reconstruction, bag_sum

pytestmark = pytest.mark.usefixtures("one_thread")


def random_sae(d_in=12, d_sae=40, k=5, activation="topk", seed=0) -> SparseAutoencoder:
    sae = SparseAutoencoder(d_in, d_sae, k, activation, generator=gen(seed))
    with torch.no_grad():  # biases away from 0, so that a sign or a missing term shows
        sae.b_enc.copy_(torch.randn(d_sae, generator=gen(seed + 1)) * 0.3)
        sae.b_dec.copy_(torch.randn(d_in, generator=gen(seed + 2)))
    return sae.eval()


def params(sae: SparseAutoencoder) -> list[np.ndarray]:
    return [p.detach().double().numpy() for p in (sae.W_enc, sae.b_enc, sae.b_dec)]


def test_encode_and_decode_are_the_numpy_formulas() -> None:
    sae = random_sae()
    x = torch.randn(30, 12, generator=gen(3)) * 2
    W_enc, b_enc, b_dec = params(sae)
    acts = numpy_encode(x.double().numpy(), W_enc, b_enc, b_dec, k=5)
    assert_close(sae.encode(x), acts, "encode")
    W_dec = sae.W_dec.detach().double().numpy()
    assert_close(sae.decode(sae.encode(x)), numpy_decode(acts, W_dec, b_dec), "decode")
    assert_close(sae(x), numpy_decode(acts, W_dec, b_dec), "forward")


def test_topk_keeps_exactly_k_features_per_token_and_none_negative() -> None:
    sae = random_sae(k=7)
    with torch.no_grad():
        sae.b_enc.add_(5.0)  # every pre-activation positive: the count is k exactly
    acts = sae.encode(torch.randn(50, 12, generator=gen(4)))
    assert ((acts > 0).sum(1) == 7).all()
    sae = random_sae(k=7)
    with torch.no_grad():
        sae.b_enc.sub_(50.0)  # every pre-activation negative: nothing is active
    acts = sae.encode(torch.randn(50, 12, generator=gen(4)))
    assert (acts == 0).all()


def test_batchtopk_keeps_k_per_token_on_average_then_runs_as_a_jumprelu() -> None:
    sae = random_sae(k=4, activation="batchtopk").train()
    with torch.no_grad():
        sae.b_enc.add_(5.0)
    x = torch.randn(25, 12, generator=gen(5))
    pre = sae.pre_acts(x)
    rows, features, values = sae.select(pre)
    assert len(values) == 4 * 25 and (values > 0).all()
    # the batch's 100 largest pre-activations, wherever they are
    assert_close(values.sort().values, pre.flatten().topk(100).values.sort().values, "kept")
    assert torch.equal(pre[rows, features], values)
    sae.eval()
    with torch.no_grad():
        sae.threshold.fill_(5.2)
    acts = sae.encode(x)
    expected = torch.where(pre > 5.2, pre, torch.zeros(()))
    assert_close(acts, expected, "jumprelu")


def test_batchtopk_inference_keeps_what_is_above_the_threshold_not_what_equals_it() -> None:
    sae = random_sae(d_sae=4, activation="batchtopk").eval()
    with torch.no_grad():
        sae.threshold.fill_(0.5)
    rows, features, values = sae.select(torch.tensor([[1.0, 0.5, 0.25, 0.5000001]]))
    assert (rows.tolist(), features.tolist()) == ([0, 0], [0, 3])
    assert values.tolist() == [1.0, torch.tensor(0.5000001).item()]


def test_the_batchtopk_threshold_follows_the_smallest_kept_activation() -> None:
    sae = random_sae(activation="batchtopk")
    sae.update_threshold(torch.tensor([0.0, 2.0, 3.0]))
    assert_close(sae.threshold, torch.full((40,), 0.02), "threshold")  # 0.99 * 0 + 0.01 * 2


def test_the_sparse_decode_equals_the_dense_one() -> None:
    for activation in ("topk", "batchtopk"):
        sae = random_sae(activation=activation).train()
        x = torch.randn(20, 12, generator=gen(6))
        rows, features, values = sae.select(sae.pre_acts(x))
        dense = torch.zeros(20, 40).index_put_((rows, features), values, accumulate=True)
        assert_close(sae.decode_sparse(rows, features, values, 20), sae.decode(dense), activation)


def test_bag_sum_adds_weighted_rows_in_any_order() -> None:
    W = torch.randn(6, 3, generator=gen(7))
    rows, features = torch.tensor([2, 0, 2, 2]), torch.tensor([5, 1, 1, 5])
    values = torch.tensor([1.0, 2.0, -1.0, 0.5])
    expected = torch.zeros(4, 3)
    expected[0] = 2.0 * W[1]
    expected[2] = 1.5 * W[5] - W[1]
    assert_close(bag_sum(W, rows, features, values, 4), expected, "bag")


def test_auxk_reconstructs_from_the_dead_features_only() -> None:
    sae = random_sae(k=3)
    pre = torch.randn(10, 40, generator=gen(8)).abs()
    dead = torch.zeros(40, dtype=torch.bool)
    dead[[3, 7, 11, 20]] = True
    out = aux_reconstruction(sae, pre, dead, torch.zeros(10, 12), k_aux=2)
    W_dec, p = sae.W_dec.detach().numpy(), pre.numpy()
    for i in range(10):
        ids = np.array([3, 7, 11, 20])
        top = ids[np.argsort(p[i, ids])[-2:]]
        assert_close(out[i], p[i, top] @ W_dec[top], f"row {i}")


def test_the_decoder_stays_unit_norm_and_its_gradient_along_a_row_is_dropped() -> None:
    sae = random_sae()
    with torch.no_grad():
        sae.W_dec.mul_(3.0)
    sae.W_dec.grad = sae.W_dec.detach() * 2 + torch.randn(40, 12, generator=gen(9))
    sae.normalize_decoder_()
    assert_close(sae.W_dec.norm(dim=1), torch.ones(40), "norms")
    sae.remove_parallel_grad_()
    assert_close((sae.W_dec.grad * sae.W_dec).sum(1), torch.zeros(40), "along")


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"k": 0}, "--k (0) must be at least 1"),
        ({"features": 8, "k": 9}, "--k (9) must be at most --features (8)"),
        ({"activation": "relu"}, "--activation ('relu') must be one of topk, batchtopk"),
        ({"steps": 0}, "--steps (0) must be at least 1"),
        ({"lr": -1.0}, "--lr (-1.0) must be a positive number"),
        ({"hook": ""}, "--hook"),
    ],
)
def test_a_bad_setting_is_named_with_its_rule(settings, words) -> None:
    with pytest.raises(InputError, match=words.replace("(", r"\(").replace(")", r"\)")):
        SAEConfig(**{"hook": "blocks.0.mlp_out", **settings})
