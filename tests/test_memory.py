"""Memory estimates and checks before training (llmcli/training/memory.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from llmcli.config import config_from_dict
from llmcli.errors import InputError
from llmcli.model.gpt import Transformer
from llmcli.training.memory import RUNTIME_BYTES, check_memory, estimate_memory

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = {"n_layer": 2, "n_head": 4, "n_embed": 64, "context_length": 32}


def _config(model: dict | None = None, **train: object):
    return config_from_dict({"model": {**SHAPE, **(model or {})}, "train": train}, name="t")


@pytest.mark.parametrize(
    "model",
    [
        {},
        {"tie_embeddings": False},
        {"pos_emb": "rope"},
        {"bias": False, "norm": "rmsnorm", "qk_norm": True, "mlp": "relu2"},
        {"n_layer": 3, "n_embed": 48, "n_head": 4},
    ],
)
def test_parameters_and_the_fixed_parts_are_the_built_models(model: dict) -> None:
    config = _config(model, batch_size=4)
    built = Transformer(config.model, 50)
    n = sum(p.numel() for p in built.parameters())  # a tied weight is one Parameter
    C = config.model.n_embed
    embeddings = 50 * C * (0 if config.model.tie_embeddings else 1)
    embeddings += 32 * C if config.model.pos_emb == "learned" else 0
    est = estimate_memory(config, 50)
    assert est.params == n
    assert est.params_non_embedding == n - embeddings
    assert (est.weights, est.grads, est.optimizer) == (4 * n, 4 * n, 8 * n)  # fp32, AdamW
    assert est.peak == est.weights + est.grads + est.optimizer + est.activations + est.runtime
    assert est.runtime == RUNTIME_BYTES["cpu"]


def test_muon_keeps_one_momentum_per_hidden_matrix_and_ddp_doubles_the_gradients() -> None:
    config = _config(optimizer="muon")
    n = sum(p.numel() for p in Transformer(config.model, 50).parameters())
    hidden = 2 * (3 * 64 * 64 + 64 * 64 + 4 * 64 * 64 + 4 * 64 * 64)  # qkv, proj, fc, proj
    est = estimate_memory(config, 50, world_size=2)
    assert est.optimizer == 4 * (2 * (n - hidden) + hidden)
    assert est.grads == 2 * 4 * n


def test_half_precision_adds_weight_copies_and_halves_most_activations() -> None:
    config = _config(batch_size=3)
    fp32 = estimate_memory(config, 50, "cuda", "float32")
    bf16 = estimate_memory(config, 50, "cuda", "bfloat16")
    assert bf16.weights == fp32.weights + 2 * fp32.params
    L, C, BT = 2, 64, 3 * 32
    assert bf16.activations == fp32.activations // 2 + BT * 2 * L * 2 * C  # fp32 residual
    assert bf16.runtime == RUNTIME_BYTES["cuda"]


def _saved_for_backward(model: Transformer, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for the backward pass (parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    return sum(kept.values())


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_activations_cover_what_autograd_keeps_and_scale_with_the_batch(dropout: float) -> None:
    # With dropout, the CPU's SDPA keeps the (B, nh, T, T) weights: the estimate must follow.
    config = _config({"dropout": dropout}, batch_size=4)
    model = Transformer(config.model, 50, generator=torch.Generator().manual_seed(0)).train()
    x = torch.randint(0, 50, (4, 32), generator=torch.Generator().manual_seed(1))
    kept = _saved_for_backward(model, x)
    est = estimate_memory(config, 50)
    # Above what is kept (the backward pass adds temporaries), by at most half.
    assert kept <= est.activations <= 1.5 * kept
    assert estimate_memory(config, 50, batch_size=12).activations == 3 * est.activations


def test_check_memory_refuses_what_cannot_fit_and_honours_memory_limit() -> None:
    config = _config(batch_size=4)
    check_memory(config, 50, torch.device("cpu"), "float32")  # fits in RAM
    need = estimate_memory(config, 50).peak
    limited = _config(batch_size=4, memory_limit=need)
    check_memory(limited, 50, torch.device("cpu"), "float32")  # exactly enough
    limited = _config(batch_size=4, memory_limit=need - 1)
    with pytest.raises(InputError, match=r"train.memory_limit allows .* lower model.n_embed"):
        check_memory(limited, 50, torch.device("cpu"), "float32")
    huge = _config({"n_embed": 1_000_000, "n_head": 1}, batch_size=4)
    with pytest.raises(InputError, match=r"needs about [\d,.]+ [KMGT]?i?B .* lower model.n_embed"):
        check_memory(huge, 50, torch.device("cpu"), "float32")


def test_estimating_a_rotary_model_does_not_import_torch_compiler() -> None:
    # The estimate runs at the start of every `train` and `plan`: building the rotary embedding on
    # the meta device would import torch._dynamo (most of a second). The count must still equal
    # the built model's.
    code = (
        "import sys\n"
        "from llmcli.config import Config, ModelConfig\n"
        "from llmcli.model.gpt import Transformer\n"
        "from llmcli.training.memory import estimate_memory\n"
        "c = Config(model=ModelConfig(n_layer=2, n_embed=32, pos_emb='rope', norm='rmsnorm'))\n"
        "est = estimate_memory(c, 65)\n"
        "print('DYNAMO', 'torch._dynamo' in sys.modules)\n"
        "built = sum(p.numel() for p in Transformer(c.model, 65).parameters())\n"
        "print('PARAMS', est.params, built)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "DYNAMO False" in out.stdout
    params = next(line for line in out.stdout.splitlines() if line.startswith("PARAMS")).split()
    assert params[1] == params[2]


def _objective_config(objective: str, batch_size: int, **train: object):
    data = {"dpo": "preference", "grpo": "prompts"}[objective]
    return config_from_dict(
        {
            "model": SHAPE,
            "data": {"format": data, "path": "rows.jsonl"},
            "train": {"objective": objective, "init_from": "base", "batch_size": batch_size}
            | train,
        },
        name="t",
    )


def test_a_grpo_step_is_sized_at_batch_size_x_group_size_rows_and_its_reference() -> None:
    plain = estimate_memory(_config(batch_size=2 * 4), 50)
    grpo = estimate_memory(_objective_config("grpo", 2, group_size=4), 50)
    assert grpo.activations == plain.activations  # 2 prompts x 4 completions: 8 rows
    assert grpo.reference == 0  # no KL penalty, no reference
    kl = estimate_memory(_objective_config("grpo", 2, group_size=4, grpo_beta=0.04), 50)
    assert kl.reference == 4 * kl.params  # the frozen init_from model, fp32
    assert kl.peak == grpo.peak + kl.reference
    # Sampling a step's completions (grad_accum x batch_size x group_size rows at once) holds
    # each row's keys and values and logits; it comes before the step's forwards.
    L, C, T = SHAPE["n_layer"], SHAPE["n_embed"], SHAPE["context_length"]
    accum = estimate_memory(_objective_config("grpo", 2, group_size=4, grad_accum=3), 50)
    assert accum.sampling == 3 * 2 * 4 * T * (2 * L * C + 50) * 4
    assert plain.sampling == 0
    dpo = estimate_memory(_objective_config("dpo", 4), 50)
    assert dpo.activations > plain.activations and dpo.reference == 4 * dpo.params


def test_a_group_size_that_cannot_fit_is_refused_naming_it() -> None:
    config = _objective_config("grpo", 2, group_size=1_000_000)
    with pytest.raises(
        InputError, match=r"2 prompts \(1,000,000 completions each\), 2,000,000 rows"
    ):
        check_memory(config, 50, torch.device("cpu"), "float32")
    with pytest.raises(InputError, match=r"lower train.group_size, model.n_embed"):
        check_memory(config, 50, torch.device("cpu"), "float32")
