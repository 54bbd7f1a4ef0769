"""Transcoders (`llmcli.inspection.sae.transcoder*`): the formulas against NumPy, the training
on a run's MLPs with its files in circuit-tracer's layout, and exact resume after Ctrl-C."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from model_helpers import assert_close
from sae_helpers import small_run
from safetensors.torch import load_file

from llmcli.errors import CheckpointError, InputError
from llmcli.inspection.sae import transcoder_train
from llmcli.inspection.sae.config import SAEConfig
from llmcli.inspection.sae.folder import METRICS_FILE, STATE_FILE
from llmcli.inspection.sae.points import read_points
from llmcli.inspection.sae.state import SAEState
from llmcli.inspection.sae.train import TrainOptions
from llmcli.inspection.sae.transcoder import Transcoder
from llmcli.inspection.sae.transcoder_eval import measure_transcoders
from llmcli.inspection.sae.transcoder_folder import CONFIG_FILE, load_transcoders
from llmcli.inspection.sae.transcoder_train import parse_layers, train_transcoders
from llmcli.runs.loading import load_run
from llmcli.training.interrupt import Preempted

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    return small_run(tmp_path_factory.mktemp("run") / "run", small_corpus)


def transcoder_config(**settings) -> SAEConfig:
    """Transcoders of 64 features on every layer, k 4, 6 steps of 128 activations."""
    values = {"kind": "transcoder", "layers": "all", "features": 64, "k": 4, "steps": 6}
    values |= {"batch_tokens": 128, "log_interval": 2, "save_interval": 3}
    return SAEConfig(**{**values, **settings})


def trained(run, out, **settings):
    train_transcoders(transcoder_config(**settings), TrainOptions(checkpoint=run, out=out))
    return out


def randomized(activation: str, skip: bool = False) -> Transcoder:
    tc = Transcoder(8, 32, 3, activation, skip, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in tc.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        tc.threshold.fill_(0.5)
    return tc


@pytest.mark.parametrize("activation", ["topk", "batchtopk", "relu", "tanh"])
def test_encode_and_decode_are_circuit_tracers_formulas_written_out_in_numpy(activation) -> None:
    tc = randomized(activation, skip=True).eval()
    x = torch.randn(20, 8, generator=torch.Generator().manual_seed(3))
    W_enc, b_enc, W_dec, b_dec, W_skip = (
        t.detach().double().numpy() for t in (tc.W_enc, tc.b_enc, tc.W_dec, tc.b_dec, tc.W_skip)
    )
    pre = x.double().numpy() @ W_enc.T + b_enc  # (N, F)
    if activation == "topk":  # the 3 largest as they are, no ReLU (circuit-tracer's TopK)
        acts = np.zeros_like(pre)
        for i, row in enumerate(pre):
            top = np.argsort(row)[-3:]
            acts[i, top] = row[top]
    elif activation == "batchtopk":  # a JumpReLU at the learned threshold
        acts = pre * (pre > 0.5)
    else:
        acts = np.maximum(pre, 0.0)
    out = acts @ W_dec + b_dec + x.double().numpy() @ W_skip.T
    with torch.no_grad():
        assert_close(tc.encode(x).double(), torch.from_numpy(acts), "encode", atol=1e-5)
        assert_close(tc(x).double(), torch.from_numpy(out), "forward", atol=1e-4)


def test_the_penalties_are_l1_and_tanh_of_the_activations_times_the_decoder_norms() -> None:
    pre = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    for activation, f in (("relu", lambda s: s), ("tanh", lambda s: np.tanh(4.0 * s))):
        tc = randomized(activation)
        scaled = np.maximum(pre.numpy(), 0) * tc.W_dec.detach().norm(dim=1).numpy()
        expected = f(scaled).sum(-1).mean()
        assert tc.penalty(pre).item() == pytest.approx(expected, rel=1e-5)
    assert randomized("topk").penalty(pre).item() == 0.0


def test_a_training_writes_circuit_tracers_transcoder_set(run, tmp_path) -> None:
    folder = trained(run, tmp_path / "tc", skip=True, activation="batchtopk")
    cfg = yaml.safe_load((folder / CONFIG_FILE).read_text())
    assert cfg["model_kind"] == "transcoder_set"
    assert (cfg["feature_input_hook"], cfg["feature_output_hook"]) == (
        "mlp.hook_in",
        "mlp.hook_out",
    )
    assert cfg["transcoders"] == ["layer_0.safetensors", "layer_1.safetensors"]
    assert "activation" not in cfg  # circuit-tracer runs a thresholded set as its JumpReLU
    for layer in (0, 1):
        tensors = load_file(folder / f"layer_{layer}.safetensors")
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        assert shapes == {
            "W_enc": (64, 16),
            "W_dec": (64, 16),
            "b_enc": (64,),
            "b_dec": (16,),
            "W_skip": (16, 16),
            "activation_function.threshold": (64,),
        }
        assert tensors["activation_function.threshold"].min() > 0  # learned
    loaded = load_transcoders(folder)
    assert loaded.transcoders.layers == [0, 1] and loaded.info.step == 6
    lines = [json.loads(line) for line in (folder / METRICS_FILE).read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 4, 6]
    assert lines[-1]["kind"] == "transcoder" and lines[-1]["l0"] > 0


def test_a_transcoder_learns_to_predict_the_mlps_output(run, tmp_path) -> None:
    """Its prediction on held-out windows beats the mean output it starts from."""
    folder = trained(run, tmp_path / "tc", steps=60, lr=3e-3, k=8)
    model = load_run(run).model
    idx = torch.randint(0, 30, (4, 16), generator=torch.Generator().manual_seed(9))
    rows = read_points(model, ["blocks.1.mlp_in", "blocks.1.mlp_out"], idx)
    x, y = rows["blocks.1.mlp_in"], rows["blocks.1.mlp_out"]
    with torch.no_grad():
        fvu = (load_transcoders(folder).transcoders[1](x) - y).pow(2).sum() / (
            (y - y.mean(0)).pow(2).sum()
        )
    assert fvu < 0.5


@pytest.mark.parametrize("activation", ["relu", "tanh", "topk"])
def test_each_activation_trains_and_loads_back_as_it_computed(run, tmp_path, activation) -> None:
    folder = trained(run, tmp_path / activation, activation=activation, layers="1", steps=2)
    cfg = yaml.safe_load((folder / CONFIG_FILE).read_text())
    assert cfg["activation"] == {"relu": "relu", "tanh": "relu", "topk": "topk"}[activation]
    assert cfg["transcoders"] == ["layer_1.safetensors"]
    state = SAEState.load(folder / STATE_FILE)
    loaded = load_transcoders(folder).transcoders
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state.sae[name]), name


def test_a_resumed_training_ends_with_the_same_weights_bit_for_bit(
    run, tmp_path, monkeypatch
) -> None:
    straight = load_transcoders(trained(run, tmp_path / "straight")).transcoders
    real, calls = transcoder_train.BatchSampler.next, []

    def interrupted(self):  # Ctrl-C as the fifth step draws its windows: the step ends first
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self)

    monkeypatch.setattr(transcoder_train.BatchSampler, "next", interrupted)
    with pytest.raises(KeyboardInterrupt) as stopped:
        trained(run, tmp_path / "half")
    assert not isinstance(stopped.value, Preempted)
    assert SAEState.load(tmp_path / "half" / STATE_FILE).step == 5
    monkeypatch.undo()
    half = tmp_path / "half"
    options = TrainOptions(checkpoint=run, out=half, resume=True)
    train_transcoders(transcoder_config(), options)
    resumed = load_transcoders(half).transcoders
    for name, tensor in straight.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
    lines = (half / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4, 6]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"hook": "blocks.0.mlp_out"}, r"--hook \('blocks.0.mlp_out'\) is for SAEs"),
        ({"activation": "jumprelu"}, r"--activation .* must be one of topk, batchtopk, relu"),
        ({"sparsity_coef": -1.0}, r"--sparsity-coef \(-1.0\) must be 0 or more"),
    ],
)
def test_bad_transcoder_settings_are_refused_naming_the_option(settings, message) -> None:
    with pytest.raises(InputError, match=message):
        transcoder_config(**settings)


def test_layers_are_all_or_indices_of_the_run() -> None:
    assert parse_layers("all", 3) == [0, 1, 2] and parse_layers("2,0", 3) == [0, 2]
    for bad in ("3", "x", "", "-1"):
        with pytest.raises(InputError, match=r"must be all, or layers of the run .* 0\.\.2"):
            parse_layers(bad, 3)
    with pytest.raises(InputError, match="applies to --kind transcoder only"):
        SAEConfig(hook="blocks.0.mlp_out", layers="all")


def test_eval_replaces_every_mlp_at_once_as_a_forward_written_out_does(run, tmp_path) -> None:
    folder = trained(run, tmp_path / "tc", steps=20)
    loaded, model = load_transcoders(folder), load_run(run).model
    tcs = loaded.transcoders
    x = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(5))
    y = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(6))
    figures = measure_transcoders(loaded, load_run(run), [(x, y)])
    with torch.no_grad():  # the blocks by hand, each MLP replaced by its transcoder
        h = model.embedding(x)
        for layer, block in enumerate(model.blocks):
            h = h + block.attn(block.ln1(h))
            h = h + tcs[layer](block.ln2(h).flatten(0, 1)).view_as(h)
        replaced = F.cross_entropy(model.to_logits(h).flatten(0, 1), y.flatten())
        clean = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten())
        h = model.embedding(x)  # and each MLP's output zeroed
        for block in model.blocks:
            h = h + block.attn(block.ln1(h))
        zero = F.cross_entropy(model.to_logits(h).flatten(0, 1), y.flatten())
    assert figures["ce_replaced"] == pytest.approx(replaced.item(), rel=1e-5)
    assert figures["ce_clean"] == pytest.approx(clean.item(), rel=1e-5)
    assert figures["ce_zero"] == pytest.approx(zero.item(), rel=1e-5)
    recovered = (zero - replaced) / (zero - clean)
    assert figures["ce_recovered"] == pytest.approx(recovered.item(), rel=1e-4)
    rows = read_points(model, ["blocks.1.mlp_in", "blocks.1.mlp_out"], x)
    inp, out = rows["blocks.1.mlp_in"], rows["blocks.1.mlp_out"]
    with torch.no_grad():
        nmse = (tcs[1](inp) - out).pow(2).sum() / (out - out.mean(0)).pow(2).sum()
        l0 = (tcs[1].encode(inp) != 0).float().sum(-1).mean()
    assert figures["nmse"][1] == pytest.approx(nmse.item(), rel=1e-4)
    assert figures["l0"][1] == pytest.approx(l0.item())
    fired = (tcs[1].encode(inp) != 0).any(0).float().mean()  # features active on some token
    assert figures["dead_fraction"][1] == pytest.approx(1 - fired.item())


def test_a_damaged_config_is_refused_naming_the_file(run, tmp_path) -> None:
    folder = trained(run, tmp_path / "tc", layers="1", steps=2)
    good = yaml.safe_load((folder / CONFIG_FILE).read_text())
    bad_k = {**good, "llmcli": {**good["llmcli"], "settings": {"k": "many"}}}
    no_layers = {**good, "llmcli": {**good["llmcli"], "layers": []}}
    for text, message in (
        ("", "is not an llmcli transcoder set"),
        ("- a list\n", "is not an llmcli transcoder set"),
        (yaml.safe_dump(bad_k), "lacks or misreads invalid literal for int()"),
        (yaml.safe_dump(no_layers), "lists no layer"),
    ):
        (folder / CONFIG_FILE).write_text(text)
        with pytest.raises(CheckpointError) as exc:
            load_transcoders(folder)
        assert message in str(exc.value) and str(folder / CONFIG_FILE) in str(exc.value)
    (folder / CONFIG_FILE).write_text(yaml.safe_dump(good))
    assert load_transcoders(folder).transcoders.layers == [1]
