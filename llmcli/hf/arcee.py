"""llmcli's model as Arcee (`ArceeForCausalLM`): rotary positions with RMSNorm, ungated MLP.

Arcee is Llama's architecture with an ungated MLP, `down(act(up(x)))` with `hidden_act` "relu2"
or "gelu" (exact), which is llmcli's MLP; gated Llama-family models (`gate_proj`, SwiGLU) are not.

| llmcli | Hugging Face `ArceeForCausalLM` |
| --- | --- |
| `wte` | `model.embed_tokens` |
| `blocks.{i}.ln1`, `.ln2` | `model.layers.{i}.input_layernorm`, `.post_attention_layernorm` |
| `blocks.{i}.attn.qkv` | `model.layers.{i}.self_attn.q_proj`, `.k_proj`, `.v_proj` (row blocks) |
| `blocks.{i}.attn.proj` | `model.layers.{i}.self_attn.o_proj` |
| `blocks.{i}.mlp.fc`, `.mlp.proj` | `model.layers.{i}.mlp.up_proj`, `.down_proj` |
| `ln_f`, `lm_head` | `model.norm`, `lm_head` |

llmcli's fused QKV rows are every head's queries, then keys, then values, each head-major: exactly
`q_proj`, `k_proj` and `v_proj` stacked. Rotary embeddings use the same "rotate half" layout
and frequencies (`base**(-2i/hs)`, whole head), RMSNorm the same formula and epsilon, and the
attention the same `1/sqrt(hs)` scale with as many key/value heads as query heads. Biases match
one to one: RMSNorm has none, and llmcli's `model.bias` is Arcee's `attention_bias` (on q, k, v
and o) and `mlp_bias` together.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from llmcli.config import ModelConfig
from llmcli.hf.common import (
    Problem,
    activation,
    config_file,
    cpu,
    field,
    leftovers,
    mismatches,
    model_shape,
    refuse,
    rope_parameters,
    take,
    warn_eps,
)
from llmcli.model.gpt import Transformer

NAME = "arcee"
MODEL_TYPE = "arcee"
HF_CLASS = "ArceeForCausalLM"
_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def problems(model_cfg: ModelConfig) -> list[Problem]:
    """The options Arcee cannot compute exactly (none: it can export the run)."""
    why_not = ", and the Llama-family models that have one use a gated MLP"
    return mismatches(model_cfg, "Arcee", pos_emb="rope", norm="rmsnorm", qk_note=why_not)


def hf_config(
    model_cfg: ModelConfig, vocab_size: int, eot_id: int | None, eps: float
) -> dict[str, Any]:
    """The `config.json` of the Arcee equivalent of `model_cfg`."""
    settings = {
        "hidden_size": model_cfg.n_embed,
        "intermediate_size": 4 * model_cfg.n_embed,
        "num_hidden_layers": model_cfg.n_layer,
        "num_attention_heads": model_cfg.n_head,
        "num_key_value_heads": model_cfg.n_head,
        "head_dim": model_cfg.n_embed // model_cfg.n_head,
        "hidden_act": model_cfg.mlp,
        "max_position_embeddings": model_cfg.context_length,
        "rms_norm_eps": eps,
        # transformers 5.x reads rope_parameters, 4.x rope_theta and rope_scaling.
        "rope_parameters": {"rope_type": "default", "rope_theta": model_cfg.rope_base},
        "rope_theta": model_cfg.rope_base,
        "rope_scaling": None,
        "attention_bias": model_cfg.bias,
        "mlp_bias": model_cfg.bias,
        "attention_dropout": model_cfg.attention_dropout,
        "initializer_range": 0.02,
    }
    return config_file(HF_CLASS, MODEL_TYPE, vocab_size, settings, eot_id, model_cfg.tie_embeddings)


# llmcli's target inside a block -> Arcee's modules (the fused QKV is three).
_LORA_MODULES = {
    "attn.qkv": tuple(f"self_attn.{kind}" for kind in _PROJECTIONS),
    "attn.proj": ("self_attn.o_proj",),
    "mlp.fc": ("mlp.up_proj",),
    "mlp.proj": ("mlp.down_proj",),
}
LORA_FAN_IN_FAN_OUT = False
# The token embedding, whose rows a LoRA run adds train as PEFT's trainable tokens.
LORA_EMBEDDING = "model.embed_tokens"


def lora_to_hf(name: str, B: torch.Tensor, n_head: int) -> dict[str, torch.Tensor]:
    """An adapted layer (`blocks.0.attn.qkv`) -> the Arcee modules its adapter goes on, each
    with its rows of `B (out, r)`: the fused QKV's adapter becomes three, q_proj, k_proj and
    v_proj, that share `A` (`[Bq; Bk; Bv] A` is `Bq A`, `Bk A`, `Bv A` stacked; `n_head`
    unused, the row blocks are whole kinds)."""
    _, i, target = name.split(".", 2)
    modules = [f"model.layers.{i}.{m}" for m in _LORA_MODULES[target]]
    rows = B.chunk(3) if target == "attn.qkv" else (B,)
    return {m: b.contiguous() for m, b in zip(modules, rows, strict=True)}


def to_hf(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under Arcee names and layouts (CPU, contiguous)."""
    out = {"model.embed_tokens.weight": cpu(model.wte.weight)}
    for i, block in enumerate(model.blocks):
        prefix = f"model.layers.{i}"
        out[f"{prefix}.input_layernorm.weight"] = cpu(block.ln1.weight)
        out[f"{prefix}.post_attention_layernorm.weight"] = cpu(block.ln2.weight)
        attn, mlp = block.attn, block.mlp
        for kind, rows in zip(_PROJECTIONS, cpu(attn.qkv.weight).chunk(3), strict=True):
            out[f"{prefix}.self_attn.{kind}.weight"] = rows.contiguous()
        out[f"{prefix}.self_attn.o_proj.weight"] = cpu(attn.proj.weight)
        out[f"{prefix}.mlp.up_proj.weight"] = cpu(mlp.fc.weight)
        out[f"{prefix}.mlp.down_proj.weight"] = cpu(mlp.proj.weight)
        if attn.qkv.bias is not None:  # model.bias: every linear layer has one
            for kind, rows in zip(_PROJECTIONS, cpu(attn.qkv.bias).chunk(3), strict=True):
                out[f"{prefix}.self_attn.{kind}.bias"] = rows.contiguous()
            out[f"{prefix}.self_attn.o_proj.bias"] = cpu(attn.proj.bias)
            out[f"{prefix}.mlp.up_proj.bias"] = cpu(mlp.fc.bias)
            out[f"{prefix}.mlp.down_proj.bias"] = cpu(mlp.proj.bias)
    out["model.norm.weight"] = cpu(model.ln_f.weight)
    if not model.tie_embeddings:
        out["lm_head.weight"] = cpu(model.lm_head.weight)
    return out


def model_config(hf_cfg: dict[str, Any], base: ModelConfig, source: str) -> ModelConfig:
    """llmcli's `ModelConfig` for an Arcee `config.json` (`base` gives dropout).

    Raises:
        InputError: a missing key, or features llmcli's model cannot hold (all named).
    """
    shape = model_shape(hf_cfg, source)
    n_embed, n_head = shape["n_embed"], shape["n_head"]
    refused = []
    kv_heads = field(hf_cfg, source, "num_key_value_heads", int) or n_head
    if kv_heads != n_head:
        refused.append(f"grouped-query attention ({kv_heads} key/value heads for {n_head})")
    head_dim = field(hf_cfg, source, "head_dim", int, n_embed // n_head)
    if head_dim != n_embed // n_head:
        refused.append(f"head_dim {head_dim} (llmcli: hidden_size / heads)")
    inner = field(hf_cfg, source, "intermediate_size", int, 4 * n_embed)
    if inner != 4 * n_embed:
        refused.append(f"intermediate_size {inner} (llmcli: 4 * hidden)")
    bias = field(hf_cfg, source, "attention_bias", bool, False)
    if bias != field(hf_cfg, source, "mlp_bias", bool, False):
        refused.append("attention_bias and mlp_bias differ (llmcli has one bias setting)")
    rope = rope_parameters(hf_cfg, source)
    if rope["rope_type"] != "default" or rope["partial_rotary_factor"] != 1.0:
        refused.append(f"rope scaling {rope['rope_type']!r} (llmcli: plain rotary, whole heads)")
    mlp = activation(hf_cfg, "hidden_act", "relu2", source)
    if mlp is None:
        refused.append(f"hidden_act {hf_cfg.get('hidden_act')!r} (llmcli: relu2 or gelu)")
    refuse(source, refused, "Arcee")
    warn_eps(hf_cfg, "rms_norm_eps", source)
    return dataclasses.replace(
        base,
        **shape,
        bias=bias,
        pos_emb="rope",
        rope_base=rope["rope_theta"],
        norm="rmsnorm",
        qk_norm=False,
        mlp=mlp,
        tie_embeddings=field(hf_cfg, source, "tie_word_embeddings", bool, False),
    )


def from_hf(
    tensors: dict[str, torch.Tensor], model_cfg: ModelConfig, source: str
) -> dict[str, torch.Tensor]:
    """Arcee weights -> llmcli names and layouts.

    Raises:
        CheckpointError: a missing tensor, or tensors the config does not account for.
    """
    kinds = ("weight", "bias") if model_cfg.bias else ("weight",)
    names = {"model.embed_tokens.weight": "wte.weight", "model.norm.weight": "ln_f.weight"}
    for i in range(model_cfg.n_layer):
        p, b = f"model.layers.{i}", f"blocks.{i}"
        names[f"{p}.input_layernorm.weight"] = f"{b}.ln1.weight"
        names[f"{p}.post_attention_layernorm.weight"] = f"{b}.ln2.weight"
        for theirs, ours in (
            ("self_attn.o_proj", "attn.proj"),
            ("mlp.up_proj", "mlp.fc"),
            ("mlp.down_proj", "mlp.proj"),
        ):
            for kind in kinds:
                names[f"{p}.{theirs}.{kind}"] = f"{b}.{ours}.{kind}"
    out = {ours: take(tensors, theirs, source) for theirs, ours in names.items()}
    used = set(names)
    for i in range(model_cfg.n_layer):
        for kind in kinds:
            parts = [f"model.layers.{i}.self_attn.{proj}.{kind}" for proj in _PROJECTIONS]
            out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat(
                [take(tensors, n, source) for n in parts]
            )
            used |= set(parts)
    if not model_cfg.tie_embeddings:
        out["lm_head.weight"] = take(tensors, "lm_head.weight", source)
    used |= {"lm_head.weight"} | {k for k in tensors if k.endswith("rotary_emb.inv_freq")}
    leftovers(tensors, used, source, "Arcee")
    return {k: v.contiguous() for k, v in out.items()}
